"""What the tier experiments that compare code trees share (tier_prefault.py,
bounce_tier.py): each variant runs a child script in a fresh interpreter with one tree
of the mptier package on its path (``--old DIR`` adds an older copy), in rounds whose
order alternates, and prints the load average at both ends."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

# This checkout's tree: the folder holding the mptier package.
HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_line() -> None:
    print(f"{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}", flush=True)


def rounds(variants: Sequence[tuple], n: int) -> Iterator[tuple[int, tuple]]:
    """``(round, variant)``, every variant once a round, odd rounds in reverse order."""
    for rnd in range(n):
        for variant in (variants if rnd % 2 == 0 else variants[::-1]):
            yield rnd, variant


def run_child(script: str, tree: str, argv: Sequence[object], label: str,
              after: Sequence[str] = ()) -> dict | None:
    """Run ``script`` with ``tree`` first on the path (then the folders ``after``); its
    last line of output is a JSON record whose ``code`` names the mptier it imported
    (checked to be ``tree``'s). None (and its error printed) when it failed."""
    path = ":".join([tree, *after])
    out = subprocess.run([sys.executable, "-c", script, *map(str, argv)],
                         env=dict(os.environ, PYTHONPATH=path), cwd="/",
                         capture_output=True, text=True, check=False)
    if out.returncode:
        print(label, "failed:", out.stderr[-2000:])
        return None
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert record["code"].startswith(tree), (record["code"], tree)
    return record


# For a child script (pasted at its top): its tier's worker processes -- its children --
# with their minor faults and CPU seconds, from /proc/PID/stat.
CHILD_WORKERS = r'''
import os
TICK = os.sysconf("SC_CLK_TCK")

def workers():
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            s = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        f = s[s.rindex(")") + 2:].split()
        if int(f[1]) == os.getpid():  # ppid
            out[int(pid)] = (int(f[7]), (int(f[11]) + int(f[12])) / TICK)
    return out
'''


# For a child script (pasted after its imports, with JOB and INFLIGHT set): one phase of
# jobs of JOB blocks, INFLIGHT at once, polled every ``poll_s`` as an engine's step
# polls; returns its seconds and the last job id.
CHILD_PHASE = r'''
def phase(tier, kind, keys, slots, jid, poll_s=0.0005):
    submit = tier.submit_store if kind == "store" else tier.submit_load
    jobs = [(keys[i:i + JOB], slots[i:i + JOB]) for i in range(0, len(keys), JOB)]
    t0 = time.perf_counter(); pending = nxt = 0
    while nxt < len(jobs) or pending:
        while pending < INFLIGHT and nxt < len(jobs):
            jid += 1; submit(TransferJob(jid, *jobs[nxt])); nxt += 1; pending += 1
        done = tier.get_finished_jobs()
        assert all(r.success for r in done), done
        pending -= len(done)
        if not done:
            time.sleep(poll_s)
    return time.perf_counter() - t0, jid
'''


def flag_rounds(child: str, name: str, args: argparse.Namespace, root_prefix: str,
                argv) -> Iterator[tuple[int, str, dict]]:
    """Run ``child`` for every variant of :func:`variants` (``name`` on and off, and
    ``args.old``'s tree) in ``args.rounds`` alternating rounds, each on a fresh folder
    under ``args.root``; ``argv(flag, root)`` gives the child's arguments. Yields
    ``(round, label, record)`` for the runs that succeeded."""
    for rnd, (label, tree, flag) in rounds(variants(name, "1", "0", args.old), args.rounds):
        root = os.path.join(args.root, f"{root_prefix}-{os.getpid()}")
        record = run_child(child, tree, argv(flag, root), label)
        if record is not None:
            yield rnd, label, record


def parser(blocks: int, root: str = "/var/tmp") -> argparse.ArgumentParser:
    """The arguments every tree-comparing experiment takes (``blocks``, ``root``: its
    defaults)."""
    p = argparse.ArgumentParser()
    p.add_argument("--root", default=root, help="where each run makes its folder")
    p.add_argument("--old", help="folder holding an older copy of the mptier package")
    p.add_argument("--block", type=int, default=2 << 20)
    p.add_argument("--blocks", type=int, default=blocks)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--fill-dest", action="store_true",
                   help="allocate the destination half too (a fully written engine buffer)")
    return p


def variants(name: str, flag_on: str, flag_off: str, old: str | None) -> list[tuple]:
    """``(label, tree, flag)``: this tree with the setting on and off, and ``old``'s tree
    with it on first where given."""
    out = [(f"new {name}", HERE, flag_on), (f"no {name}", HERE, flag_off)]
    if old:
        out.insert(0, (f"old {name}", os.path.abspath(old), flag_on))
    return out
