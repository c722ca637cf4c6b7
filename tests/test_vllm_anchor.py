"""The vLLM that mptier is measured and tested against has its C extension.

vLLM's file-system tier stores, loads and looks up whole batches in ``vllm.fs_io_C``
when it loads (``vllm.v1.kv_offload.tiering.fs.io._HAS_FSIO_C`` and
``...fs.manager._HAS_BATCH_LOOKUP_C``), as on every CUDA deployment; the wheel's copy
links CUDA libraries, so ``scripts/vllm-env.sh`` builds it from vLLM's sdist. These
tests hold that environment to it, run vLLM's own tests of its tier from the cached
sdist, and check the bench's ``vllm`` design (which refuses to run without the
extension) and ``vllm-py`` design (vLLM's Python fallback on purpose) by counting which
of vLLM's functions ran. All are marked ``vllm`` and skip where vLLM is not installed
(``.venv-vllm/bin/python -m pytest -q -m vllm``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mptier.bench import cli, harness
from mptier.bench.measure import CacheDrop

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed in this interpreter; "
                       "make the environment with scripts/vllm-env.sh and run "
                       ".venv-vllm/bin/python -m pytest -m vllm"),
]

FLAGS = [("vllm.v1.kv_offload.tiering.fs.io", "_HAS_FSIO_C"),
         ("vllm.v1.kv_offload.tiering.fs.manager", "_HAS_BATCH_LOOKUP_C")]
VLLM_FS_TEST = "tests/v1/kv_offload/tiering/test_fs_tier.py"
# A tiny bench run: enough jobs and lookups to reach every one of vLLM's entry points.
TINY = ["--block-bytes", "64K", "--job-blocks", "4", "--inflight-jobs", "4",
        "--total-bytes", "2M", "--single-job-blocks", "8", "--repeats", "1",
        "--idle-seconds", "0.05", "--poll-us", "200", "--busy-work-us", "200",
        "--no-progress", "--no-cold-pass"]


def sdist_cache() -> Path:
    """Where scripts/vllm-env.sh keeps the sdist's files (same rule as the script)."""
    import vllm

    base = os.environ.get("MPTIER_VLLM_CACHE")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = os.path.join(xdg, "mptier") if xdg else os.path.expanduser("~/.cache/mptier")
    return Path(base) / f"vllm-sdist-{vllm.__version__}"


@pytest.fixture
def fake_drop(monkeypatch) -> None:
    """Record nothing, drop nothing: the whole machine's page cache stays."""
    monkeypatch.setattr(harness, "drop_page_cache", lambda: CacheDrop(True))


def run_bench(tmp_path, designs: str) -> tuple[int, dict]:
    out = tmp_path / "out.json"
    rc = cli.main(["--root", str(tmp_path), *TINY, "--json", str(out),
                   "--designs", designs])
    return rc, json.loads(out.read_text())


def test_vllm_loads_its_c_extension_built_from_the_sdist():
    import vllm
    import vllm.fs_io_C as ext

    for module, flag in FLAGS:
        assert getattr(importlib.import_module(module), flag) is True, \
            f"{module}.{flag} is False: run scripts/vllm-env.sh"
    assert Path(ext.__file__) == Path(vllm.__file__).parent / "fs_io_C.abi3.so"
    # The build from the sdist links no torch or CUDA library (the wheel's did).
    linked = subprocess.run(["ldd", ext.__file__], capture_output=True, text=True,
                            check=True).stdout
    # The names and paths only: a load address such as 0x00007f843533e000 holds "c10"
    # now and then (CI, 2026-12-04).
    libraries = [line.split(" (0x")[0].strip() for line in linked.splitlines()]
    assert "libc.so.6" in " ".join(libraries), linked  # the parse sees the libraries
    assert not [lib for lib in libraries if re.search(r"torch|c10|cuda|nvrtc", lib)], linked


# vLLM's 46 cases take 1.5 min on an idle 2-core machine, several on a busy one.
@pytest.mark.timeout(900)
def test_vllms_own_fs_tier_tests_pass_with_the_extension(tmp_path):
    source = sdist_cache() / VLLM_FS_TEST
    if not source.is_file():
        pytest.skip(f"{source} is missing: scripts/vllm-env.sh keeps it there (unless "
                    "MPTIER_VLLM_CACHE=none)")
    shutil.copy(source, tmp_path / source.name)
    # Its own rootdir and basetemp: nothing of this repository's conftest or pytest
    # configuration applies, and the inner run never prunes the outer run's folders.
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "basetemp"),
         source.name],
        cwd=tmp_path, capture_output=True, text=True, timeout=840)
    tail = proc.stdout[-3000:]
    assert proc.returncode == 0, tail + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    # Without the extension its C-path cases skip (35 of 46 pass in 0.33.0).
    assert "skipped" not in summary and "failed" not in summary, tail
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert passed >= 46, tail


def counted(monkeypatch, module: str, name: str) -> list[int]:
    """Count calls of vLLM's ``module.name`` (a module global its code calls)."""
    mod = importlib.import_module(module)
    fn = getattr(mod, name)
    calls: list[int] = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    monkeypatch.setattr(mod, name, wrapper)
    return calls


def test_bench_vllm_runs_the_extension_and_vllm_py_the_python_fallback(
        tmp_path, fake_drop, monkeypatch):
    from mptier.bench.vllm_tier import PATH_C, PATH_PYTHON, c_flags

    io_mod = "vllm.v1.kv_offload.tiering.fs.io"
    # vLLM's per-block Python functions: called only on its fallback path.
    py_store = counted(monkeypatch, io_mod, "_store_block")
    py_load = counted(monkeypatch, io_mod, "_load_block")
    c_store = counted(monkeypatch, io_mod, "batch_store_block_C")

    rc, doc = run_bench(tmp_path, "vllm")
    assert rc == 0, doc["cases"][0]["problems"]
    (v,) = doc["cases"][0]["designs"]
    assert v["info"]["io_path"] == PATH_C
    assert set(v["info"]["c_flags"].values()) == {True}
    calls = v["info"]["io_calls"]
    assert calls["store_batches_c"] == calls["store_batches"] > 0
    assert calls["load_batches_c"] == calls["load_batches"] > 0
    assert calls["lookup_batches_c"] > 0
    assert v["info"]["lookup_batch_c_ms"] > 0  # timed around vLLM's C lookup
    assert calls["store_batches_python"] == calls["load_batches_python"] == 0
    assert any(PATH_C in n for n in v["notes"])
    assert c_store and not py_store and not py_load
    n_c_store = len(c_store)

    rc, doc = run_bench(tmp_path, "vllm-py")
    assert rc == 0, doc["cases"][0]["problems"]
    (w,) = doc["cases"][0]["designs"]
    assert w["letter"] == "w" and w["info"]["io_path"] == PATH_PYTHON
    calls = w["info"]["io_calls"]
    assert calls["store_batches_c"] == calls["load_batches_c"] == 0
    assert calls["lookup_batches_c"] == 0
    assert w["info"]["lookup_batch_c_ms"] is None
    assert calls["store_batches_python"] > 0 and calls["load_batches_python"] > 0
    assert len(c_store) == n_c_store, "vllm-py reached vLLM's C store"
    assert py_store and py_load, "vllm-py never ran vLLM's per-block Python I/O"
    assert w["verify"]["ok"] and w["jobs"]["load"]["failed"] == 0
    # The switch was for that design alone.
    assert set(c_flags().values()) == {True}


@pytest.mark.parametrize("module,flag", FLAGS, ids=[f for _, f in FLAGS])
def test_bench_vllm_refuses_to_run_without_the_extension(tmp_path, monkeypatch, capsys,
                                                         module, flag):
    monkeypatch.setattr(importlib.import_module(module), flag, False)
    out = tmp_path / "out.json"
    rc = cli.main(["--root", str(tmp_path), *TINY, "--json", str(out),
                   "--designs", "baseline,vllm"])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"{module}.{flag} is False" in err and "scripts/vllm-env.sh" in err, err
    assert not out.exists(), "the bench ran although it refused"
    assert not list(tmp_path.glob("mptier-bench-*"))

    # Driven past the command line, the design fails its case instead of measuring.
    from mptier.bench.vllm_tier import VllmTierDesign

    with pytest.raises(RuntimeError, match=re.escape(f"{module}.{flag}")):
        VllmTierDesign("vllm").setup(None)
