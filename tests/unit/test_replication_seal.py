"""The frame tag of protocol v3 (elasticd/replication/seal.py) is the standard AEAD, used soundly.

Each frame's tag must be exactly RFC 8439's ChaCha20-Poly1305 with an empty plaintext and the
frame as associated data, under the direction's key and the frame's sequence number as nonce
(checked against ``cryptography``'s own AEAD, however the frame is split); each frame of a
direction takes a fresh nonce, so no one-time Poly1305 key is used twice; and a tag checks only
the exact bytes, at the exact position, under the exact key it was made for.
"""

from __future__ import annotations

import os
import struct

import pytest
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from elasticd.replication import seal
from elasticd.replication.seal import KEY_BYTES, ONE_SHOT_BYTES, FrameKey

KEY = bytes(range(KEY_BYTES))


def aead_tag(key: bytes, sequence: int, frame: bytes) -> bytes:
    """The library's AEAD: 96-bit nonce = 4 zero bytes then the sequence number (LE)."""
    return ChaCha20Poly1305(key).encrypt(struct.pack("<IQ", 0, sequence), b"", frame)


@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 12 + 8 + 4093, 1 << 20])
def test_the_tag_is_chacha20_poly1305_over_the_frame_as_associated_data(size):
    frame = os.urandom(size)
    key = FrameKey(KEY)
    for sequence in range(3):  # a new nonce each frame
        cut = size // 3
        tag = key.seal(frame[:cut], memoryview(frame)[cut:], b"")
        assert tag == aead_tag(KEY, sequence, frame)
    assert key._sequence == 3


def test_the_same_frame_twice_gets_two_tags_and_each_opens_only_at_its_position():
    sender, receiver = FrameKey(KEY), FrameKey(KEY)
    first, second = sender.seal(b"same bytes"), sender.seal(b"same bytes")
    assert first != second  # a fresh nonce, so a fresh one-time key
    opener = receiver.opener(second)  # the first frame's position, the second frame's tag
    opener.update(b"same bytes")
    assert not opener.verify()
    opener = receiver.opener(second)
    opener.update(b"same bytes")
    assert opener.verify()


def test_any_flipped_bit_and_any_other_key_fail_the_tag():
    frame = bytearray(os.urandom(4096))
    tag = FrameKey(KEY).seal(frame)
    for bit in (0, 7, 8 * 2048 + 3, 8 * 4096 - 1):
        forged = bytearray(frame)
        forged[bit // 8] ^= 1 << (bit % 8)
        opener = FrameKey(KEY).opener(tag)
        opener.update(forged)
        assert not opener.verify()
    opener = FrameKey(bytes(KEY_BYTES)).opener(tag)  # e.g. the other direction's key
    opener.update(frame)
    assert not opener.verify()
    for moved in (frame[:-1], frame + b"\0"):  # a length change, even by zeros
        opener = FrameKey(KEY).opener(tag)
        opener.update(moved)
        assert not opener.verify()
    opener = FrameKey(KEY).opener(tag)
    opener.update(frame)
    assert opener.verify()


def test_a_wrong_key_length_is_refused():
    with pytest.raises(ValueError, match="32 bytes"):
        FrameKey(b"short")


@pytest.mark.parametrize("size", [0, 100, ONE_SHOT_BYTES, ONE_SHOT_BYTES + 1, 3 * ONE_SHOT_BYTES])
def test_an_opener_fed_in_pieces_across_the_one_shot_size_checks_exactly_the_frame(size):
    frame = os.urandom(size)
    tag = FrameKey(KEY).seal(frame)
    assert tag == aead_tag(KEY, 0, frame)
    for pieces in ([frame], [frame[: size // 2], frame[size // 2 :]],
                   [frame[i : i + 4000] for i in range(0, size, 4000)]):
        opener = FrameKey(KEY).opener(tag)
        for piece in pieces:
            opener.update(memoryview(piece))
        assert opener.verify()
    if size:
        opener = FrameKey(KEY).opener(tag)
        opener.update(frame[:-1] + bytes([frame[-1] ^ 1]))
        assert not opener.verify()


def test_small_frames_are_sealed_and_opened_in_one_aead_call_not_streamed(monkeypatch):
    """A control frame or a pretagged frame's prefix is small: the one-shot AEAD (made once
    per key) seals and opens it, not a ChaCha20 cipher plus a Poly1305 object per frame
    (~10x the CPU, most of what a holder's Python cost per served byte)."""
    sender, receiver = FrameKey(KEY), FrameKey(KEY)

    def streamed(*args):
        raise AssertionError("a small frame was streamed")

    monkeypatch.setattr(seal, "one_time_tagger", streamed)
    frame = os.urandom(140)
    tag = sender.seal(frame[:12], frame[12:])
    opener = receiver.opener(tag)
    opener.update(frame[:12])
    opener.update(memoryview(frame)[12:])
    assert opener.verify()
