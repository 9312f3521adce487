"""How many bits a cluster secret carries, counted from its alphabet, and the minimum.

The secret is a line of text (a file, or ``ELASTICD_CLUSTER_SECRET``) whose bytes are the key
material exactly as they are (the HKDF input of :mod:`elasticd.replication.seal`): nothing is
decoded, so daemons of every version derive the same keys from the same line. Its strength,
though, is not its length in bytes: ``openssl rand -hex 8`` prints 16 characters that carry 64
bits, and a passive observer of one handshake can test guesses offline (docs/security.md). So
each character counts the bits of the smallest alphabet that holds every character of the
secret: decimal digits log2(10), hex digits 4, base64 (either flavour, ``=`` padding not
counted) 6, printable ASCII log2(95), anything else 8 (raw bytes). For the output of a random
generator in that alphabet (what operators are told to use) this is exact; for text a person
chose it is an upper bound, which is all a program can know.
"""

from __future__ import annotations

import math
import string

#: The least a cluster secret must carry (docs/security.md promises 128 bits).
MIN_SECRET_BITS = 128

_BASE64 = frozenset((string.ascii_letters + string.digits + "+/-_").encode())
#: (name, bits per character, characters), smallest first.
_ALPHABETS = (
    ("decimal digits", math.log2(10), frozenset(string.digits.encode())),
    ("hex digits", 4.0, frozenset(string.hexdigits.encode())),
    ("base64 characters", 6.0, _BASE64),
    ("printable ASCII characters", math.log2(95),
     frozenset(range(0x20, 0x7f))),
)


def secret_bits(secret: bytes) -> tuple[float, str]:
    """The bits ``secret`` carries and how they were counted (``"16 hex digits at 4 bits"``)."""
    body = bytes(secret)
    base64 = body.rstrip(b"=")
    for name, bits, chars in _ALPHABETS:
        counted = base64 if chars is _BASE64 else body
        if counted and set(counted) <= chars:
            return len(counted) * bits, f"{len(counted)} {name} at {bits:.3g} bits"
    return len(body) * 8.0, f"{len(body)} bytes at 8 bits"


def weak_secret(secret: bytes) -> str:
    """Why ``secret`` is too weak, in one line without quoting it; "" when it is strong enough."""
    bits, how = secret_bits(secret)
    if bits >= MIN_SECRET_BITS:
        return ""
    return (f"the secret carries {bits:.0f} bits ({how}), fewer than {MIN_SECRET_BITS}: use at "
            f"least {MIN_SECRET_BITS} random bits, e.g. `openssl rand -hex 32` (64 hex digits)")
