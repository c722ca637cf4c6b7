"""A worker's own CPU per task, inside the native batch call and outside it, through a
real tier (16-block jobs, 16 in flight, tmpfs root, checksums on), for this checkout
and an older copy of the package side by side, in rounds whose order alternates.

Each run is a child interpreter with one tree first on its path and, beside it, a
``sitecustomize`` that instruments the tier's worker processes only (the engine sets
the variable that turns it on after its own start): the take of a task record (the
serving loop's ``_take``, or the backend's ``record_taker`` where the tree has one) is
wrapped so that the main thread's CPU (``thread_time_ns``) from one task taken to the
next is the task's, and every native call named ``mpt_batch_*`` / ``mpt_task_*`` is
timed likewise (the core's own work, GIL released); ``--parts`` names more calls to
time apart (each timing costs ~2.6 us of its own here). A worker writes its sums when
its session ends. A load run's blocks are stored first by another tier, whose workers
are not instrumented. ``--profile`` runs every worker's session under cProfile (timed
by thread CPU) instead and prints the top of the merged profile per tree (its times
are inflated; the ranking is what it is for).

    python bench/experiments/task_cpu.py --old /tmp/old --root /dev/shm --rounds 3
    python bench/experiments/task_cpu.py --old /tmp/old --op store --blocks 4096
    python bench/experiments/task_cpu.py --block 2097152 --blocks 1024 --profile

``--old DIR``: ``git archive HEAD mptier | tar -x -C DIR`` plus the built
``_mptier_cffi*.so`` copied to ``DIR/mptier/native/``.
"""

from __future__ import annotations

import glob
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile

from ab_trees import CHILD_PHASE, CHILD_WORKERS, HERE, load_line, parser, rounds, run_child

# The workers' instrumentation (a sitecustomize: imported by every interpreter started
# with its folder on the path; it acts only where MPTIER_TASK_CPU_DIR is set).
SITECUSTOMIZE = r'''
import os, sys
OUT = os.environ.get("MPTIER_TASK_CPU_DIR")
if OUT:
    import importlib.machinery, json, re, time
    TIMED = re.compile(r"^mpt_(batch|task)_")
    thread_ns = time.thread_time_ns
    # Parts of a task timed apart: [0] the native batch calls, [1] taking the record,
    # then the calls MPTIER_TASK_PARTS names ("module:function" or
    # "module:Class.method"), each its own sum (nested ones inside their caller's too).
    PARTS = [p.split(":") for p in os.environ["MPTIER_TASK_PARTS"].split(",") if p]
    inside = [0] * (2 + len(PARTS))
    stats = {}  # task kind -> [tasks, ns from one take to the next, *inside]
    held = [None, 0]  # kind of the task in hand, thread time when it was taken

    def timing(real, at):
        def timed(*args, **kwargs):
            t = thread_ns()
            try:
                return real(*args, **kwargs)
            finally:
                inside[at] += thread_ns() - t
        return timed

    class Lib:
        """cffi's lib with the batch calls timed."""
        def __init__(self, lib):
            self._lib = lib
        def __getattr__(self, name):
            real = getattr(self._lib, name)
            if not TIMED.match(name):
                return real
            timed = timing(real, 0)
            setattr(self, name, timed)
            return timed

    def patch_cffi(module):
        module.lib = Lib(module.lib)

    def patch_parts(module):
        for at, (name, attr) in enumerate(PARTS, 2):
            if name == module.__name__:
                owner, _, attr = attr.rpartition(".")
                owner = getattr(module, owner) if owner else module
                setattr(owner, attr, timing(getattr(owner, attr), at))
        if module.__name__ == "mptier.workers.serving":
            patch_serving(module)

    def taken(took, record):
        """Close the task in hand (its sums), and start the next if one was taken."""
        now = thread_ns()
        if held[0] is not None:
            s = stats.setdefault(held[0], [0, 0] + [0] * len(inside))
            s[0] += 1
            s[1] += now - held[1]
            for i, v in enumerate(inside):
                s[2 + i] += v
        inside[:] = [0] * len(inside)
        held[0], held[1] = (record[4], now) if took else (None, 0)

    def patch_native(module):  # the take, where the backend makes it (record_taker)
        if hasattr(module.Backend, "record_taker"):
            made = module.Backend.record_taker
            def record_taker(self, fds, record):
                take = made(self, fds, record)
                def timed():
                    t = thread_ns()
                    out = take()
                    taken(out[0] >= 0, record)
                    inside[1] += thread_ns() - t
                    return out
                return timed
            module.Backend.record_taker = record_taker
        patch_parts(module)

    def patch_serving(module):
        serve = module.serve
        if hasattr(module, "_take"):  # the take, where the serving loop makes it
            take = module._take
            def _take(queues, record):
                t = thread_ns()
                took = take(queues, record)
                taken(took, record)
                inside[1] += thread_ns() - t
                return took
            module._take = _take
        def served(*args):
            if os.environ.get("MPTIER_TASK_PROFILE"):
                import cProfile
                prof = cProfile.Profile(thread_ns, 1e-9)
                try:
                    return prof.runcall(serve, *args)
                finally:
                    prof.dump_stats(f"{OUT}/{os.getpid()}.prof")
            try:
                return serve(*args)
            finally:
                with open(f"{OUT}/{os.getpid()}.json", "a") as f:
                    f.write(json.dumps(stats) + "\n")
                stats.clear()
        module.serve = served

    PATCH = {"mptier.native._mptier_cffi": patch_cffi}
    for name, _ in PARTS:
        PATCH[name] = patch_parts
    PATCH["mptier.workers.serving"] = patch_parts
    PATCH["mptier.native"] = patch_native

    class Finder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name not in PATCH:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None:
                return None
            run = spec.loader.exec_module
            def exec_module(module):
                run(module)
                PATCH[name](module)
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder)
'''

# The engine: one tier, the blocks stored (loads: first), then measured passes.
CHILD = CHILD_WORKERS + r'''
import json, os, shutil, sys, time
from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key
import mptier
block, n, op, root, passes, out = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                   sys.argv[4], int(sys.argv[5]), sys.argv[6])
loads, stores = map(int, sys.argv[7].split("+"))
TIER = dict(checksum_blocks=True, n_load_workers=loads, n_store_workers=stores)
JOB, INFLIGHT = 16, 16

def worker_cpu():
    return sum(cpu for _, cpu in workers().values())
''' + CHILD_PHASE + r'''
with SharedKVBuffer.create(2 * n, block) as buf:
    buf.view[:n] = 7
    buf.view[n:] = 1
    keys = [make_key(os.urandom(32), 0) for _ in range(n)]
    jid, res = 0, []
    if op == "load":  # stored by another tier, whose workers are not instrumented
        with FileSystemTier(buf, root_dir=root, **TIER) as tier:
            _, jid = phase(tier, "store", keys, list(range(n)), jid)
    os.environ["MPTIER_TASK_CPU_DIR"] = out  # the workers, started below, are instrumented
    tier = FileSystemTier(buf, root_dir=root, **TIER)
    for p in range(passes):
        if op == "store":
            keys = [make_key(os.urandom(32), 0) for _ in range(n)]
        c0 = worker_cpu()
        t, jid = phase(tier, op, keys, list(range(n, 2 * n)) if op == "load"
                       else list(range(n)), jid)
        res.append((n * block / t / 1e9, (worker_cpu() - c0) / (n * block / 1e9)))
    ok = op == "store" or bool((buf.view[n:] == buf.view[:n]).all())
    tier.shutdown()
    shutil.rmtree(root, ignore_errors=True)
print(json.dumps({"code": mptier.__file__, "passes": res, "ok": ok}))
'''

KIND = {1: "store", 2: "load", 3: "lookup"}
# Calls timed apart by default (--parts): module:function or module:Class.method.
PARTS = ("mptier.workers.serving:_run_task,mptier.workers.serving:_report_task,"
         "mptier.workers.caretaker:Caretaker.run")


def sums(out: str, worker: str | None = None) -> dict[str, list[int]]:
    """Every worker's sums of one run (or the worker ``worker``'s: its pid), per task
    kind."""
    total: dict[str, list[int]] = {}
    for name in glob.glob(f"{out}/{worker or '*'}.json"):
        with open(name) as f:
            for line in f:
                for kind, values in json.loads(line).items():
                    t = total.setdefault(KIND.get(int(kind), kind), [0] * len(values))
                    for i, v in enumerate(values):
                        t[i] += v
    return total


def main() -> int:
    p = parser(blocks=4096, root="/dev/shm")
    p.set_defaults(block=256 << 10)
    p.add_argument("--op", choices=("load", "store"), default="load")
    p.add_argument("--passes", type=int, default=2, help="measured passes per run")
    p.add_argument("--workers", default="2+2", help="load + store workers of the tier")
    p.add_argument("--per-worker", action="store_true", help="each worker's sums too")
    p.add_argument("--profile", action="store_true", help="cProfile the workers instead")
    p.add_argument("--top", type=int, default=25, help="profile lines shown per tree")
    p.add_argument("--parts", default=PARTS, help="calls timed apart (nested: each "
                   "also counts in its caller's; 'native' in all that reach the core)")
    args = p.parse_args()
    parts_arg = [p for p in args.parts.split(",") if p]
    os.environ["MPTIER_TASK_PARTS"] = ",".join(parts_arg)
    site = tempfile.mkdtemp(prefix="task-cpu-site-")
    with open(f"{site}/sitecustomize.py", "w") as f:
        f.write(SITECUSTOMIZE)
    variants = [("new", HERE)] + ([("old", os.path.abspath(args.old))] if args.old else [])
    per: dict[str, list] = {label: [] for label, _ in variants}
    profiles: dict[str, list[str]] = {label: [] for label, _ in variants}
    if args.profile:
        os.environ["MPTIER_TASK_PROFILE"] = "1"
    load_line()
    try:
        for rnd, (label, tree) in rounds(variants, args.rounds):
            out = tempfile.mkdtemp(prefix="task-cpu-out-")
            root = os.path.join(args.root, f"mptier-task-cpu-{os.getpid()}")
            try:
                record = run_child(CHILD, tree, [args.block, args.blocks, args.op, root,
                                                 args.passes, out, args.workers],
                                   label, after=[site])
                if record is None:
                    continue
                if args.profile:
                    profiles[label] += _keep(glob.glob(f"{out}/*.prof"), site, label)
                kinds = sums(out)
                if args.per_worker:
                    for name in sorted(glob.glob(f"{out}/*.json")):
                        pid = os.path.basename(name)[:-5]
                        t, c, *v = sums(out, pid).get(args.op, [0, 0, 0])
                        print(f"  worker {pid}: {t} tasks, us per task: whole "
                              f"{c / max(t, 1) / 1e3:.0f}, in it: "
                              f"{' '.join(f'{x / max(t, 1) / 1e3:.0f}' for x in v)}")
            finally:
                shutil.rmtree(root, ignore_errors=True)
                shutil.rmtree(out, ignore_errors=True)
            if args.profile:  # (the sums are not written then)
                print(f"round {rnd} {label}: profiled", flush=True)
                continue
            names = ["native", "take", *(p.rpartition(":")[2] for p in parts_arg)]
            tasks, cycle, *parts = kinds.get(args.op, [0] * (2 + len(names)))
            tasks = max(tasks, 1)
            us = dict(zip(names, (v / tasks / 1e3 for v in parts)), whole=cycle / tasks / 1e3)
            per[label].append((us, record["passes"]))
            print(f"round {rnd} {label}: {tasks} {args.op} tasks; us per task: "
                  f"{' '.join(f'{k} {v:.0f}' for k, v in us.items())}; outside native "
                  f"{us['whole'] - us['native']:.0f}; GB/s "
                  f"{' '.join(f'{g:.2f}' for g, _ in record['passes'])}, workers CPU "
                  f"s/GB {' '.join(f'{c:.3f}' for _, c in record['passes'])}; ok "
                  f"{record['ok']}", flush=True)
        load_line()
        med = statistics.median
        for label, rows in per.items():
            if rows:
                us = {k: med(r[0][k] for r in rows) for k in rows[0][0]}
                print(f"{label}: per {args.op} task, us (median of {len(rows)}): "
                      f"{' '.join(f'{k} {v:.0f}' for k, v in us.items())}; outside native "
                      f"{med(r[0]['whole'] - r[0]['native'] for r in rows):.0f}; GB/s "
                      f"{med(g for r in rows for g, _ in r[1]):.2f}, workers CPU s/GB "
                      f"{med(c for r in rows for _, c in r[1]):.3f}")
            if profiles[label]:
                print(f"--- {label}: cProfile of the workers' sessions, by own time")
                pstats.Stats(*profiles[label], stream=sys.stdout).sort_stats(
                    "tottime").print_stats(args.top)
    finally:
        shutil.rmtree(site, ignore_errors=True)
    return 0


def _keep(files: list[str], site: str, label: str) -> list[str]:
    """Move a run's profiles out of its folder (removed next) into the instrumentation's
    (removed at the end), named by tree."""
    kept = []
    for name in files:
        kept.append(f"{site}/{label}-{len(os.listdir(site))}.prof")
        shutil.move(name, kept[-1])
    return kept


if __name__ == "__main__":
    sys.exit(main())
