"""What the threads of a ``perf record -e sched:sched_switch -g -a`` record waited for
in uninterruptible sleep: each switch-out in state D (worker processes, io_uring's
helper threads, Python) until the same thread's next switch-in, summed per reason read
off its kernel stack -- the lock of a folder taken for a mkdir, a path walk waiting for
that lock, a metadata read, the journal. Waits of several threads at once all count.

    perf record -e sched:sched_switch -g -a -o /tmp/sw.data -- \\
        python bench/experiments/fresh_fill.py --rounds 1
    perf script -i /tmp/sw.data -F comm,tid,time,event,trace,ip,sym > /tmp/sw.txt
    python bench/experiments/offcpu_waits.py /tmp/sw.txt

docs/performance.md, section 24.
"""

from __future__ import annotations

import collections
import re
import sys

SWITCH = re.compile(r"prev_comm=(\S+) prev_pid=(\d+) .*prev_state=(\S+) ==> "
                    r"next_comm=(\S+) next_pid=(\d+)")
STAMP = re.compile(r"\s*\S+\s+\d+\s+([\d.]+):")
THREADS = ("iou-wrk", "python", "mptier")
# A deletion's discards and a sync are the harness's own, not the fill's.
LEFT_OUT = ("discard", "sync")


def reason(stack: str) -> str:
    if "rwsem_down_write" in stack:
        return "folder lock, for a mkdir"
    if "rwsem_down_read" in stack:
        return "folder lock, a path walk waiting for a mkdir"
    if "jbd2" in stack or "start_this_handle" in stack:
        return "journal"
    if any(s in stack for s in ("folio_wait", "bit_wait", "ext4_read_bh",
                                "get_inode_loc", "find_entry")):
        return "metadata read"
    return "other: " + " ".join(stack.split()[2:5])


def main(path: str) -> None:
    out: dict[int, tuple[float, str]] = {}
    total: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    with open(path) as f:
        events = f.read().split("\n\n")
    for event in events:
        lines = event.strip().splitlines()
        if not lines:
            continue
        stamp, switch = STAMP.match(lines[0]), SWITCH.search(lines[0])
        if stamp is None or switch is None:
            continue
        now = float(stamp.group(1))
        comm, prev, state, nxt = switch.group(1), int(switch.group(2)), switch.group(3), \
            int(switch.group(5))
        if nxt in out:
            began, why = out.pop(nxt)
            total[why] += now - began
            count[why] += 1
        stack = " ".join(re.sub(r"^[0-9a-f]+\s+", "", line.strip()).split("+")[0]
                         for line in lines[1:15])
        if state == "D" and comm.startswith(THREADS) and \
                not any(s in stack for s in LEFT_OUT):
            out[prev] = (now, reason(stack))
    for why, seconds in total.most_common():
        print(f"{seconds * 1e3:10.1f} ms over {count[why]:6d} waits  {why}")


if __name__ == "__main__":
    main(sys.argv[1])
