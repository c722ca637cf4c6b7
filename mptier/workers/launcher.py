"""Starting one worker process: a fresh interpreter (no fork of the engine, whose
threads and locks must not be copied), handed exactly two descriptors -- its end of a
control socket and the pool's control block. Everything else (queues, pipes, the
buffer) arrives later over the control socket, one session at a time.

The worker runs the engine's own mptier, whatever folder the engine was started from:
``python -m`` (and ``-c``) would put the working folder first on ``sys.path``, so an
``mptier`` folder there (a source checkout, anything planted) would be what the
workers import. The interpreter is started with a small ``-c`` script instead that
drops the working folder from ``sys.path`` and imports the engine's package from its
own folder (Python 3.10 has no ``-P``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field

import mptier
from mptier.config import default_of
from mptier.workers.protocol import control_pair

# The engine's own ``mptier`` package folder: the workers import it from there.
PACKAGE_DIR = os.path.dirname(os.path.abspath(mptier.__file__))
# sys.argv of the script: [-c, PACKAGE_DIR, boot spec]. Under -c, sys.path[0] is the
# working folder ("", unless PYTHONSAFEPATH left it out): it goes. Then the package is
# imported from its file, so every ``mptier.*`` import follows its ``__path__``, while
# the rest of sys.path is left as it is (putting site-packages in front could shadow
# the standard library with an old backport). First of all the script blocks SIGUSR1
# (mptier.workers.orphan.ORPHAN_SIGNAL), before any import can start a thread (numpy's
# BLAS pool does): a thread that did not block it would take the signal's default
# action, death, where the worker means to leave in order.
_BOOT_SCRIPT = """\
import signal
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
import sys
if sys.path and sys.path[0] == "":
    del sys.path[0]
import importlib.util
spec = importlib.util.spec_from_file_location(
    "mptier", sys.argv[1] + "/__init__.py", submodule_search_locations=[sys.argv[1]])
package = importlib.util.module_from_spec(spec)
sys.modules["mptier"] = package
spec.loader.exec_module(package)
from mptier.workers.worker import main
sys.exit(main(sys.argv[1], sys.argv[2]))
"""


@dataclass
class BootSpec:
    """What every worker of one pool starts with."""

    n_slots: int
    control_block_fd: int
    backend: str = "native"
    worker_nice: int = default_of("worker_nice")  # the TierConfig fields of these names
    worker_cpus: list[int] = field(default_factory=list)
    # Also caps how long a worker outlives its supervisor.
    io_timeout_s: float = default_of("io_timeout_s")
    in_engine: bool = True  # the supervisor runs in the engine (not in mptier serve)


def launch(boot: BootSpec, slot: int, role: str) -> tuple[subprocess.Popen, socket.socket]:
    """Start a worker for ``slot``; returns the process and the supervisor's end of its
    control socket at once (the worker says ``ready`` itself). Raises ``OSError``."""
    supervisor_end, worker_end = control_pair()
    try:
        spec = {
            "slot": slot, "role": role, "n_slots": boot.n_slots,
            "control_block": boot.control_block_fd, "control_socket": worker_end.fileno(),
            "backend": boot.backend, "nice": boot.worker_nice, "cpus": boot.worker_cpus,
            "io_timeout_s": boot.io_timeout_s, "in_engine": boot.in_engine,
            "parent_pid": os.getpid(),
        }
        proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT_SCRIPT, PACKAGE_DIR, json.dumps(spec)],
            pass_fds=(boot.control_block_fd, worker_end.fileno()),
            stdin=subprocess.DEVNULL, close_fds=True)
    except BaseException:
        supervisor_end.close()
        raise
    finally:
        worker_end.close()
    return proc, supervisor_end
