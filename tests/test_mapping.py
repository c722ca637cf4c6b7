"""Pre-faulting the primary buffer: existing pages are mapped, holes are never filled."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import pathlib
import resource

import pytest

from mptier import mapping
from mptier.mapping import PAGE_SIZE, MappedBuffer, Segment

MIB = 1 << 20


@pytest.fixture
def sparse_shm():
    """A 16 MiB /dev/shm file (unlinked at once) whose MiB 0-3 and 8 hold data."""
    path = f"/dev/shm/mptier-test-mapping.{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.unlink(path)
    os.ftruncate(fd, 16 * MIB)
    os.pwrite(fd, b"\x07" * (4 * MIB), 0)
    os.pwrite(fd, b"\x09" * MIB, 8 * MIB)
    yield fd
    os.close(fd)


def allocated(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_prefault_maps_resident_pages_and_allocates_nothing(sparse_shm):
    before = allocated(sparse_shm)
    buf = MappedBuffer([Segment(sparse_shm, 0, 16 * MIB, 0)], 16 * MIB)
    try:
        result = buf.prefault()
        assert result.method == "populate_read"
        assert result.mapped_bytes == 5 * MIB
        assert result.hole_bytes == 11 * MIB
        assert allocated(sparse_shm) == before  # no hole was filled
        # Writing the resident pages now takes no fault (the read-populated entries of a
        # shared shmem mapping are writable) -- what a load into a slot does.
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf.memory))
        faults = minor_faults()
        ctypes.memset(addr, 1, 4 * MIB)
        ctypes.memset(addr + 8 * MIB, 1, MIB)
        assert minor_faults() - faults < 16, "resident pages were not mapped"
        # A hole still faults (and allocates) on first write, as without a tier.
        faults = minor_faults()
        ctypes.memset(addr + 12 * MIB, 1, MIB)
        assert minor_faults() - faults >= MIB // PAGE_SIZE // 2
        assert allocated(sparse_shm) == before + MIB
    finally:
        buf.close()


def test_prefault_without_populate_advice_touches_resident_pages_only(sparse_shm,
                                                                      monkeypatch):
    real = mapping._libc

    class OldKernel:  # madvise(MADV_POPULATE_READ) is EINVAL before Linux 5.14
        mmap, munmap, mincore = real.mmap, real.munmap, real.mincore

        @staticmethod
        def madvise(addr, length, advice):
            ctypes.set_errno(errno.EINVAL)
            return -1

    monkeypatch.setattr(mapping, "_libc", OldKernel)
    before = allocated(sparse_shm)
    buf = MappedBuffer([Segment(sparse_shm, 0, 16 * MIB, 0)], 16 * MIB)
    try:
        result = buf.prefault()
        assert (result.method, result.mapped_bytes) == ("touch", 5 * MIB)
        assert allocated(sparse_shm) == before
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf.memory))
        faults = minor_faults()
        ctypes.memset(addr, 2, 4 * MIB)
        assert minor_faults() - faults < 16
        assert bytes(buf.memory[8 * MIB:8 * MIB + 4]) == b"\x09" * 4  # values kept
    finally:
        buf.close()


def test_prefault_of_a_two_segment_buffer(tmp_path):
    """Segments back to back (vLLM's .mmap, .mmap.1): both are covered."""
    fds = []
    try:
        for i in range(2):
            path = f"/dev/shm/mptier-test-mapping-seg{i}.{os.getpid()}"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.unlink(path)
            os.ftruncate(fd, 2 * MIB)
            os.pwrite(fd, b"\x05" * MIB, 0)  # first half of each segment resident
            fds.append(fd)
        buf = MappedBuffer([Segment(fd, 0, 2 * MIB, i * 2 * MIB) for i, fd in enumerate(fds)],
                           4 * MIB)
        try:
            result = buf.prefault()
            assert (result.mapped_bytes, result.hole_bytes) == (2 * MIB, 2 * MIB)
            assert [allocated(fd) for fd in fds] == [MIB, MIB]
        finally:
            buf.close()
    finally:
        for fd in fds:
            os.close(fd)


def test_page_size_is_the_mapping_unit():
    assert PAGE_SIZE == mmap.PAGESIZE


@pytest.mark.parametrize("case", ["past the file", "gap", "short of nbytes", "no segments"])
def test_a_buffer_is_mapped_only_where_its_files_are(sparse_shm, case):
    """What an engine claims about its buffer is checked against its descriptors (fstat)
    before a worker maps it: a mapping past a file's end would fault on first touch, and
    its length bounds every block the native layer moves."""
    size = os.fstat(sparse_shm).st_size
    segments, nbytes = {
        "past the file": ([Segment(sparse_shm, PAGE_SIZE, size, 0)], size),
        "gap": ([Segment(sparse_shm, 0, MIB, 0), Segment(sparse_shm, MIB, MIB, 2 * MIB)],
                3 * MIB),
        "short of nbytes": ([Segment(sparse_shm, 0, MIB, 0)], 2 * MIB),
        "no segments": ([], MIB),
    }[case]
    with pytest.raises(ValueError, match=r"segment|buffer"):
        MappedBuffer(segments, nbytes)
    buf = MappedBuffer([Segment(sparse_shm, 0, size, 0)], size)  # the whole file: fine
    try:
        assert len(buf.memory) == size
    finally:
        buf.close()


@pytest.fixture
def mounted():
    """``mount(kind, options)`` -> a fresh mount under this run's mount folder (root
    only), unmounted and removed at teardown."""
    import subprocess

    from support import mounts

    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    made = []

    def mount(kind: str, options: str) -> str:
        point = mounts.new_mount_dir(f"{kind}-")
        made.append(point)
        subprocess.run(["mount", "-t", kind, "-o", options, "mptier-test", str(point)],
                       check=True, capture_output=True, timeout=30)
        return str(point)
    yield mount
    for point in made:
        mounts.unmount(point)
        os.rmdir(point)


def _segment_in(folder: str, nbytes: int = 4 * MIB) -> Segment:
    fd = os.open(folder, os.O_TMPFILE | os.O_RDWR, 0o600)
    os.ftruncate(fd, nbytes)
    return Segment(fd, 0, nbytes, 0)


def _sysfs(name: str) -> str:
    return pathlib.Path("/sys/kernel/mm/transparent_hugepage", name).read_text()


def _shmem_word() -> str:
    text = _sysfs("shmem_enabled")
    return text[text.index("[") + 1:text.index("]")]


def test_page_bytes_are_the_buffer_files_own(mounted, tmp_path):
    """hugetlbfs gives its own pages, a tmpfs that asks for huge pages the PMD size, the
    smallest segment decides, and a disk file, a plain tmpfs, a memfd (under this
    machine's shmem_enabled) and an empty list give the base page."""
    word = _shmem_word()
    if word in ("force", "deny"):
        pytest.skip(f"shmem_enabled is {word}: it overrides every mount's huge= option")
    huge = int(_sysfs("hpage_pmd_size"))
    plain = _segment_in(mounted("tmpfs", "size=8m,huge=never"))
    asked = _segment_in(mounted("tmpfs", "size=8m,huge=within_size"))
    hugetlb = os.open(mounted("hugetlbfs", "mode=0700"), os.O_RDONLY)
    disk = _segment_in(str(tmp_path))
    memfd = os.memfd_create("mptier-test-pages")
    try:
        assert mapping.page_bytes([plain]) == PAGE_SIZE
        assert mapping.page_bytes([asked]) == huge
        assert mapping.page_bytes([Segment(hugetlb, 0, huge, 0)]) == huge
        assert mapping.page_bytes([asked, plain]) == PAGE_SIZE
        assert mapping.page_bytes([disk]) == PAGE_SIZE
        assert mapping.page_bytes([Segment(memfd, 0, 0, 0)]) == (
            huge if word in ("always", "within_size") else PAGE_SIZE)
        assert mapping.page_bytes([]) == PAGE_SIZE
        assert mapping.page_bytes([Segment(-1, 0, 0, 0)]) == PAGE_SIZE  # cannot ask
    finally:
        for fd in (plain.fd, asked.fd, hugetlb, disk.fd, memfd):
            os.close(fd)
