"""Helpers shared by the native-layer tests (test_native*.py, test_crc32c.py).

A test module imports the fixtures it uses (``io_fixture``, ``backend_fixture``,
``shim_fixture``, ``no_fault_fixture``); each is registered under its short name
(``io``, ``backend``, ``shim``, and the autouse ``_no_fault``).

The ``io`` fixture switches what those suites claim to cover: the compiled core with
openat2 resolution ("native"), the compiled core forced onto its O_NOFOLLOW walk
("native-walk"), the compiled core's io_uring path ("native-uring": several blocks in
flight; skipped, saying why, where this kernel refuses io_uring), and the pure-Python
twin ("python"). A native variant is skipped,
saying why, only when the compiled core is not built. The LD_PRELOAD shim
(native_shim.c) makes a file system refuse things on purpose and logs what the I/O code
did at the moment it did it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from mptier import native

BLOCK = 8192  # two pages: aligned blocks take the O_DIRECT path
ALIGN = 4096
TESTS_DIR = str(Path(__file__).resolve().parent)
SRC_ROOT = str(Path(native.__file__).resolve().parents[2])  # for child interpreters
IO_VARIANTS = ["native", "native-walk", "native-uring", "python"]


class IO:
    """One backend plus one way of resolving paths; the ``batch_*`` wrappers and the errno
    layer of :class:`mptier.native.Backend` with the variant's resolution flag added."""

    def __init__(self, variant: str) -> None:
        name, *how = variant.split("-")
        self.variant = variant
        self.backend = native.get_backend(name)  # ImportError when not built
        self.walk = "walk" in how
        self.uring = "uring" in how
        if self.uring and not self.backend.uring_available():
            raise ImportError(f"io_uring path not testable here: {self.backend.uring_status()}")
        self.resolve_flags = ((native.NO_OPENAT2 if self.walk else 0)
                              | (native.URING if self.uring else 0))

    def __repr__(self) -> str:
        return f"<IO {self.variant}>"

    @property
    def name(self) -> str:
        return self.backend.name

    def batch_store(self, root, paths, buffer, offsets, block_bytes, **options):
        options.setdefault("no_openat2", self.walk)
        options.setdefault("uring", self.uring)
        return self.backend.batch_store(root, paths, buffer, offsets, block_bytes, **options)

    def batch_load(self, root, paths, buffer, offsets, block_bytes, **options):
        options.setdefault("no_openat2", self.walk)
        options.setdefault("uring", self.uring)
        return self.backend.batch_load(root, paths, buffer, offsets, block_bytes, **options)

    def batch_lookup(self, root, paths, block_bytes, **options):
        options.setdefault("no_openat2", self.walk)
        options.setdefault("uring", self.uring)
        return self.backend.batch_lookup(root, paths, block_bytes, **options)

    def store(self, root_fd, paths, buffer, offsets, block_bytes, flags, tag, found=None):
        return self.backend.store(root_fd, paths, buffer, offsets, block_bytes,
                                  flags | self.resolve_flags, tag, found)

    def load(self, root_fd, paths, buffer, offsets, block_bytes, flags):
        return self.backend.load(root_fd, paths, buffer, offsets, block_bytes,
                                 flags | self.resolve_flags)

    def lookup(self, root_fd, paths, block_bytes, flags=0):
        return self.backend.lookup(root_fd, paths, block_bytes, flags | self.resolve_flags)

    def __getattr__(self, name):  # crc32c, probes, resolver ...
        return getattr(self.backend, name)


def assert_not_loaded_after(io: IO, buf, first: int, slots, fill: int, sources,
                            size: int = BLOCK) -> None:
    """The slots of blocks ``first..`` of a failed load: the loop never attempted them, so
    each still holds ``fill``; with io_uring they may have been read meanwhile (the
    contract: their contents are undefined, and never reported loaded), so each holds
    ``fill`` or exactly its block (``sources[k]``, the bytes stored for block k)."""
    for k in range(first, len(slots)):
        got = bytes(buf[slots[k] * size:(slots[k] + 1) * size])
        if io.uring:
            assert got in (bytes([fill]) * size, sources[k]), f"slot of block {k}"
        else:
            assert got == bytes([fill]) * size, f"block {k} was attempted"


def make_io(variant: str) -> IO:
    try:
        return IO(variant)
    except ImportError as e:
        pytest.skip(str(e))


@pytest.fixture(params=IO_VARIANTS, name="io")
def io_fixture(request) -> IO:
    return make_io(request.param)


@pytest.fixture(params=["native", "python"], name="backend")
def backend_fixture(request) -> native.Backend:
    """The two backends alone (for what does not resolve paths: CRC, probes)."""
    try:
        return native.get_backend(request.param)
    except ImportError as e:
        pytest.skip(str(e))


@pytest.fixture(autouse=True, name="_no_fault")
def no_fault_fixture():
    native.set_fault(None)
    yield
    native.set_fault(None)


def aligned(nbytes: int, seed: int | None = None) -> np.ndarray:
    """A 4096-aligned uint8 array, random if ``seed`` is given, else zeros."""
    raw = np.zeros(nbytes + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    arr = raw[start : start + nbytes]
    if seed is not None:
        arr[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return arr


def descriptors() -> dict[int, str]:
    """This process's open descriptors and what each points to (/proc/self/fd)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
    return out


def block_paths(n: int, tag: str = "") -> list[str]:
    """Relative paths shaped like the real layout: <h[:3]>/<h[3:5]>_g0/<h>.bin."""
    out = []
    for i in range(n):
        h = hashlib.sha256(f"{tag}{i}".encode()).hexdigest()
        out.append(f"{h[:3]}/{h[3:5]}_g0/{h}.bin")
    return out


def offsets(slots, block_bytes: int = BLOCK) -> list[int]:
    return [s * block_bytes for s in slots]


def write_file(path, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Path(path).write_bytes(data)


def files_under(root) -> dict[str, bytes]:
    """Every regular file under ``root`` (relative path -> bytes). Never opens anything
    else (a FIFO would block) and never follows a symlink."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            full = os.path.join(dirpath, name)
            if stat.S_ISREG(os.lstat(full).st_mode):
                out[os.path.relpath(full, root)] = Path(full).read_bytes()
    return out


def temp_files(root) -> list[str]:
    found = []
    for dirpath, _, names in os.walk(root):
        found += [os.path.relpath(os.path.join(dirpath, n), root) for n in names
                  if n.endswith(".tmp")]
    return found


def crc32c_reference(data: bytes, value: int = 0) -> int:
    """CRC32C bit by bit, straight from the definition: the oracle for both backends."""
    crc = value ^ 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(native.FAULT_ENV, None)
    # The child runs the backend its test asked for, even in a run under MPTIER_NATIVE=0
    # (README: the whole suite on the pure-Python path).
    env.pop(native.NATIVE_ENV, None)
    env["PYTHONPATH"] = os.pathsep.join(
        [SRC_ROOT, TESTS_DIR, *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra or {})
    return env


def run_python(code: str, *args: str, env: dict[str, str] | None = None,
               check: bool = True, prefix: list[str] | None = None
               ) -> subprocess.CompletedProcess:
    """Run ``code`` in a child interpreter that can import mptier and this module."""
    proc = subprocess.run([*(prefix or []), sys.executable, "-c", textwrap.dedent(code),
                           *args], env=child_env(env), capture_output=True, text=True,
                          timeout=120)
    if check:
        assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="session", name="shim")
def shim_fixture(tmp_path_factory) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the LD_PRELOAD shim")
    out = tmp_path_factory.mktemp("shim") / "shim.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out),
                    os.path.join(TESTS_DIR, "native_shim.c"), "-ldl"],
                   check=True, capture_output=True)
    return str(out)


def closed_sentinels(owned: dict[int, int]) -> list[int]:
    """(In a shim test's child.) Which of the process's own descriptors ``owned`` (fd ->
    inode when opened) are closed or now name another file; those are dropped from
    ``owned``, so each is reported once."""
    closed = []
    for fd, ino in list(owned.items()):
        try:
            same = os.fstat(fd).st_ino == ino
        except OSError:
            same = False
        if not same:
            closed.append(fd)
            del owned[fd]
    return closed


def run_attempts_and_exit(attempt, tries: int, hung_s: float, wrong: list) -> None:
    """(In a shim test's child: its last call.) ``attempt(k)`` for k = 1..tries, each on a
    new thread (a ring of its own) joined for at most ``hung_s``; a hung one goes into
    ``wrong`` and ends the tries (it is a daemon thread: the child's exit does not wait
    for it). Then prints ``wrong`` and exits 1 if it holds anything, else 0 (the parent
    checks with :func:`assert_shim_child_passed`)."""
    import threading

    for k in range(1, tries + 1):
        t = threading.Thread(target=attempt, args=(k,), daemon=True)
        t.start()
        t.join(hung_s)
        if t.is_alive():
            wrong.append((k, f"a batch still running after {hung_s} s"))
            break
    print(wrong, flush=True)
    sys.exit(1 if wrong else 0)


def assert_shim_child_passed(proc: subprocess.CompletedProcess, hits: int,
                             at_least: int) -> None:
    """A shim test's child (:func:`run_attempts_and_exit`) found nothing wrong, and the
    shim failed at least ``at_least`` io_uring_enter calls (else the test proved nothing)."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert hits >= at_least, f"only {hits} io_uring_enter calls were made to fail"


def run_with_shim(shim_so: str, modes: str, log: Path, code: str, *args: str,
                  check: bool = True) -> tuple[subprocess.CompletedProcess, int, list[str]]:
    """Run ``code`` under the shim; returns the process, the refusals made and the log."""
    proc = run_python(code, *args, check=check, env={
        "LD_PRELOAD": shim_so, "SHIM_MODE": modes, "SHIM_LOG": str(log)})
    lines = log.read_text().splitlines() if log.exists() else []
    hits = [int(x.split()[1]) for x in lines if x.startswith("hits ")]
    return proc, (hits[-1] if hits else 0), [x for x in lines if not x.startswith("hits ")]
