"""Who preempted a thread: from ``perf record -e sched:sched_switch -a``.

    perf record -e sched:sched_switch -a -o /tmp/sched.data -- python bench/experiments/tails.py
    perf script -i /tmp/sched.data -F comm,pid,tid,cpu,time,event,trace > /tmp/sched.txt
    python bench/experiments/sched_preemptions.py /tmp/sched.txt [TID]

For every switch-out of TID (default: the program perf started) while still runnable
(state R: an involuntary preemption), counts which task got the CPU (by name and
priority; 120 = nice 0, 130 = nice 10 as mptier's workers) and how long TID waited
until it ran again. Record with ``-e sched:sched_wakeup`` too, and it also charges each
wait from a wake-up (the end of a sleep) to its first run to the task that held that
CPU until then.
"""

from __future__ import annotations

import collections
import re
import sys

WAKEUP = re.compile(r"\s([\d.]+): sched:sched_wakeup: comm=\S+ pid=(\d+) ")
SWITCH = re.compile(r"\[(\d+)\]\s+([\d.]+): sched:sched_switch: prev_comm=(\S+) prev_pid=(\d+) "
                    r"prev_prio=(\d+) prev_state=(\S+) ==> next_comm=(\S+) next_pid=(\d+) "
                    r"next_prio=(\d+)")


def main() -> int:
    with open(sys.argv[1]) as f:
        lines = f.read().splitlines()
    main_tid = int(sys.argv[2]) if len(sys.argv) > 2 else None
    if main_tid is None:
        for line in lines:
            m = re.search(r"(?:prev|next)_comm=perf-exec (?:prev|next)_pid=(\d+)", line)
            if m:
                main_tid = int(m.group(1))
                break
    count: collections.Counter[str] = collections.Counter()
    waited: dict[str, float] = collections.defaultdict(float)
    out_at, who = None, None
    woken_at = None
    wake_count: collections.Counter[str] = collections.Counter()
    wake_wait: dict[str, float] = collections.defaultdict(float)
    for line in lines:
        w = WAKEUP.search(line)
        if w and int(w.group(2)) == main_tid:
            woken_at = float(w.group(1))
            continue
        m = SWITCH.search(line)
        if not m:
            continue
        _cpu, t, prev_comm, prev, prev_prio, state, nxt, nxt_pid, nxt_prio = m.groups()
        when = float(t)
        if int(nxt_pid) == main_tid and woken_at is not None:
            # woken from a sleep, it waited for the task that ran on this CPU until now
            name = f"{prev_comm}(prio {prev_prio})"
            wake_count[name] += 1
            wake_wait[name] += when - woken_at
            woken_at = None
        if int(prev) == main_tid and state.startswith("R"):
            out_at, who = when, f"{nxt}(prio {nxt_prio})"
            count[who] += 1
        if int(nxt_pid) == main_tid and out_at is not None:
            waited[who] += when - out_at
            out_at = None
    print(f"thread {main_tid}: {sum(count.values())} preemptions")
    for name, n in count.most_common(20):
        print(f"{n:6d} by {name:40s} waited {waited[name] * 1e3:9.1f} ms in all")
    print(f"thread {main_tid}: {sum(wake_count.values())} wake-ups; the CPU it woke on "
          "was running, until it got it:")
    for name, n in sorted(wake_count.items(), key=lambda kv: -wake_wait[kv[0]])[:20]:
        print(f"{n:6d} x {name:40s} waited {wake_wait[name] * 1e3:9.1f} ms in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
