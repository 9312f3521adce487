"""Slot pages: which mount backs the slot directory and whether it gives huge pages (parsed from
mountinfo), and a real slot allocated on a huge-page tmpfs mounted by the test is mapped with
2 MiB pages and pre-faulted whole, where /dev/shm's small pages are pre-faulted too."""

from __future__ import annotations

import os
import subprocess

import pytest

from elasticd.snapshot.segment import Segment
from elasticd.store.huge_pages import SlotPages, parse_mountinfo, parse_shmem_enabled, probe

MOUNTINFO = """\
22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
25 22 0:23 / /dev rw,nosuid shared:2 - devtmpfs udev rw,size=4096k
26 25 0:24 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw,size=24683656k
27 26 0:25 / /dev/shm/elasticd rw,nosuid,nodev,noexec - tmpfs elasticd-shm rw,size=1024k,huge=within_size
28 22 0:26 / /mnt/with\\040space rw - tmpfs tmpfs rw,huge=always
29 26 0:27 / /dev/shm rw - tmpfs tmpfs rw,huge=never
"""


def test_the_longest_mount_point_holding_the_path_decides():
    assert parse_mountinfo(MOUNTINFO, "/dev/shm/elasticd/slots") == (
        "/dev/shm/elasticd", "tmpfs", "within_size")
    assert parse_mountinfo(MOUNTINFO, "/dev/shm/elasticd") == (
        "/dev/shm/elasticd", "tmpfs", "within_size")
    # A sibling whose name starts the same is not inside the mount.
    assert parse_mountinfo(MOUNTINFO, "/dev/shm/elasticd-n0")[0] == "/dev/shm"
    assert parse_mountinfo(MOUNTINFO, "/var/lib/elasticd") == ("/", "ext4", "never")
    assert parse_mountinfo(MOUNTINFO, "/mnt/with space/x") == ("/mnt/with space", "tmpfs",
                                                               "always")


def test_a_later_mount_on_the_same_point_hides_the_earlier():
    # /dev/shm is mounted twice; the second (huge=never) is the one visible.
    assert parse_mountinfo(MOUNTINFO, "/dev/shm/elasticd-n0") == ("/dev/shm", "tmpfs", "never")


def test_shmem_enabled_force_and_deny_win_over_the_mount():
    assert parse_shmem_enabled("always within_size advise [never] deny force") == ""
    assert parse_shmem_enabled("always within_size advise never [deny] force") == "deny"
    assert parse_shmem_enabled("always within_size advise never deny [force]") == "force"
    assert SlotPages("/s", "tmpfs", "within_size").huge_pages
    assert SlotPages("/s", "tmpfs", "always").huge_pages
    assert not SlotPages("/s", "tmpfs", "advise").huge_pages  # fallocate has no mapping
    assert not SlotPages("/s", "tmpfs", "never").huge_pages
    assert not SlotPages("/s", "tmpfs", "within_size", override="deny").huge_pages
    assert SlotPages("/s", "tmpfs", "never", override="force").huge_pages
    assert not SlotPages("/", "ext4", "never", override="force").huge_pages
    assert "4 KiB pages" in SlotPages("/dev/shm", "tmpfs", "never").describe()
    assert "huge pages" in SlotPages("/x", "tmpfs", "always").describe()


def _smaps_of(path: str) -> dict[str, int]:
    """The kB fields of this process's mapping of ``path``."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        if line.endswith(" " + path):
            fields = {}
            for entry in lines[i + 1:]:
                key, _, value = entry.partition(":")
                if not value.strip().endswith("kB"):
                    break
                fields[key] = int(value.split()[0])
            return fields
    raise AssertionError(f"{path} is not mapped")


def _allocated(root: str, capacity: int) -> dict[str, int]:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        seg = Segment.allocate(fd, "slot", os.path.join(root, "slot"), capacity)
        try:
            return _smaps_of(os.path.join(root, "slot"))
        finally:
            seg.destroy(fd)
    finally:
        os.close(fd)


def test_a_slot_on_dev_shm_is_prefaulted_whole():
    root = f"/dev/shm/elasticd-test-pages-{os.getpid()}"
    os.mkdir(root, 0o700)
    try:
        fields = _allocated(root, 8 << 20)
    finally:
        os.rmdir(root)
    assert fields["Rss"] == 8 << 10  # every page mapped before anything is copied in


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")
def test_a_slot_on_a_huge_page_tmpfs_is_mapped_with_huge_pages(tmp_path):
    point = str(tmp_path / "huge")
    os.mkdir(point)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,huge=within_size,mode=0700",
                    "elasticd-test", point], check=True)
    try:
        pages = probe(os.path.join(point, "slots"))
        assert pages.mount_point == point and pages.fs_type == "tmpfs"
        assert pages.huge == "within_size"
        override = parse_shmem_enabled(open("/sys/kernel/mm/transparent_hugepage/"
                                            "shmem_enabled").read())
        assert pages.huge_pages == (override != "deny")
        fields = _allocated(point, 8 << 20)
        assert fields["Rss"] == 8 << 10
        if pages.huge_pages:
            # 2 MiB pages mapped by the page-middle directory: the whole slot, or all but
            # pages the kernel could not find contiguous memory for.
            assert fields["ShmemPmdMapped"] >= 4 << 10, fields
    finally:
        subprocess.run(["umount", point], check=True)
    assert probe(point).mount_point != point


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")
def test_scratch_on_a_huge_page_tmpfs_takes_small_pages_and_a_full_mount_is_an_error(tmp_path):
    """Restore scratch takes small pages even where the mount gives huge ones (the first
    touch of a huge page the host took back after idle costs four times a small one's,
    bench/results/first_touch.json), and a range the tmpfs has no room for raises where a
    write would have been killed by SIGBUS."""
    from elasticd.store.shm import SlotStore

    point = str(tmp_path / "huge")
    os.mkdir(point)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,huge=within_size,mode=0700",
                    "elasticd-test", point], check=True)
    try:
        store = SlotStore(os.path.join(point, "slots"), scratch_keep=0)
        try:
            seg = store.scratch.new(32 << 20, job="job")  # only sized: more than the mount holds
            seg.reserve_range(0, 8 << 20)
            fields = _smaps_of(seg.path)
            assert fields["Rss"] == 8 << 10 and fields["ShmemPmdMapped"] == 0, fields
            with pytest.raises(OSError):
                seg.reserve_range(8 << 20, 32 << 20)
            store.scratch.drop(seg)
        finally:
            store.close()
    finally:
        subprocess.run(["umount", point], check=True)
