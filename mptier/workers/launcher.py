"""Starting one worker process: a fresh interpreter (no fork of the engine, whose
threads and locks must not be copied), handed exactly the descriptors it needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from mptier.mapping import Segment


@dataclass
class LaunchSpec:
    """Everything a worker needs, except its slot and role (see :func:`launch`)."""

    n_slots: int
    control_fd: int
    lookup_queue_fd: int
    load_queue_fd: int
    store_queue_fd: int
    completion_fd: int
    lifeline_fd: int
    doorbell_fd: int
    doorbell_write_fd: int
    segments: list[Segment]
    nbytes: int
    block_bytes: int
    layout: dict[str, Any]
    use_o_direct: bool
    native: bool
    nice: int = 0
    cpus: list[int] = field(default_factory=list)
    prefault: bool = True

    def descriptors(self) -> tuple[int, ...]:
        return (self.control_fd, self.lookup_queue_fd, self.load_queue_fd,
                self.store_queue_fd,
                self.completion_fd, self.lifeline_fd, self.doorbell_fd,
                self.doorbell_write_fd, *(s.fd for s in self.segments))


def launch(spec: LaunchSpec, slot: int, role: str) -> subprocess.Popen:
    """Start a worker for ``slot``; returns at once (the worker reports READY itself)."""
    own, other = ((spec.load_queue_fd, spec.store_queue_fd) if role == "load"
                  else (spec.store_queue_fd, spec.load_queue_fd))
    payload = {
        "slot": slot, "role": role, "n_slots": spec.n_slots, "control_fd": spec.control_fd,
        "lookup_fd": spec.lookup_queue_fd, "own_fd": own, "other_fd": other,
        "completion_fd": spec.completion_fd,
        "lifeline_fd": spec.lifeline_fd, "doorbell_fd": spec.doorbell_fd,
        "doorbell_write_fd": spec.doorbell_write_fd, "segments": [asdict(s) for s in spec.segments],
        "nbytes": spec.nbytes, "block_bytes": spec.block_bytes, "layout": spec.layout,
        "use_o_direct": spec.use_o_direct, "native": spec.native, "nice": spec.nice,
        "cpus": spec.cpus, "prefault": spec.prefault, "parent_pid": os.getpid(),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "mptier.workers.worker", json.dumps(payload)],
        pass_fds=spec.descriptors(), stdin=subprocess.DEVNULL, close_fds=True,
    )
