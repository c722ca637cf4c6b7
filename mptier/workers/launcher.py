"""Starting one worker process: a fresh interpreter (no fork of the engine, whose
threads and locks must not be copied), handed exactly two descriptors -- its end of a
control socket and the pool's control block. Everything else (queues, pipes, the
buffer) arrives later over the control socket, one session at a time."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field

from mptier.workers.protocol import control_pair


@dataclass
class BootSpec:
    """What every worker of one pool starts with."""

    n_slots: int
    control_block_fd: int
    backend: str = "native"
    nice: int = 0
    cpus: list[int] = field(default_factory=list)


def launch(boot: BootSpec, slot: int, role: str) -> tuple[subprocess.Popen, socket.socket]:
    """Start a worker for ``slot``; returns the process and the supervisor's end of its
    control socket at once (the worker says ``ready`` itself). Raises ``OSError``."""
    supervisor_end, worker_end = control_pair()
    try:
        spec = {
            "slot": slot, "role": role, "n_slots": boot.n_slots,
            "control_block": boot.control_block_fd, "control_socket": worker_end.fileno(),
            "backend": boot.backend, "nice": boot.nice, "cpus": boot.cpus,
            "parent_pid": os.getpid(),
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "mptier.workers.worker", json.dumps(spec)],
            pass_fds=(boot.control_block_fd, worker_end.fileno()),
            stdin=subprocess.DEVNULL, close_fds=True)
    except BaseException:
        supervisor_end.close()
        raise
    finally:
        worker_end.close()
    return proc, supervisor_end
