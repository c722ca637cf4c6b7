"""A long-lived Python process in another PID namespace (as in a container that shares the
host's ``/dev/shm``), which a test drives through pipes.

    test process                  unshare --pid --fork --mount-proc --kill-child
                                    └─ init (python, pid 1 inside): reaps, exits with ...
    PidNamespace.eval("...") ──────────└─ server (python, pid 2 inside, or inner_pid)
        stdin/stdout JSON lines         exec/eval snippets in one persistent namespace

The server is deliberately *not* the namespace's init: pid 1 ignores signals it has no
handler for and is an unusual pid to probe, whereas an engine in a container is an ordinary
process. ``inner_pid`` asks the kernel (``ns_last_pid``) for a chosen pid inside, e.g. one
that is alive outside too, to test code that trusts pid numbers across namespaces.

Only the PID namespace (and, for a private ``/proc``, the mount namespace) is new: the file
systems are the same, so ``/dev/shm`` objects and files are shared both ways. Needs root
(``unshare``); :meth:`close` ends the whole namespace (its init's death kills every process
in it). Methods are not thread-safe.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import textwrap

import psutil

# Interpreter start plus the handshake; generous for a loaded 2-core machine.
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0

_BOOT = textwrap.dedent(r"""
    import json, os, sys, traceback
    want = int(sys.argv[1])
    if want > 1:
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(want - 1))
    child = os.fork()
    if child == 0:
        out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)  # a snippet's print() must not corrupt the reply stream
        scope = {"__name__": "__pidns__", "os": os, "sys": sys}
        out.write(json.dumps({"ok": True, "pid": os.getpid()}) + "\n")
        for line in sys.stdin:
            req = json.loads(line)
            try:
                if req["op"] == "eval":
                    reply = {"ok": True, "value": eval(req["code"], scope)}
                else:
                    exec(req["code"], scope)
                    reply = {"ok": True, "value": None}
                text = json.dumps(reply)
            except BaseException as exc:
                text = json.dumps({"ok": False, "error": "".join(
                    traceback.format_exception(type(exc), exc, exc.__traceback__))})
            out.write(text + "\n")
        os._exit(0)
    # init: reap everything until the server is gone, then leave (ending the namespace)
    while True:
        pid, status = os.wait()
        if pid == child:
            sys.exit(os.waitstatus_to_exitcode(status) & 0xFF)
""")


def pidns_unavailable_reason() -> str | None:
    """Why a PID namespace cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "a new PID namespace needs root (unshare --pid)"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    return None


def ns_pids(pid: int) -> list[int]:
    """A process's pid in each namespace from the outermost in (``NSpid`` of its status)."""
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return [int(p) for p in line.split()[1:]]
    return [pid]


class PidNamespace:
    """A Python server in a new PID namespace. ``real_pid`` is its pid as this process sees
    it, ``ns_pid`` as it sees itself. :meth:`eval` / :meth:`run` execute code there (one
    persistent global scope, in which ``os`` and ``sys`` are imported); errors come back
    as ``RuntimeError`` with the traceback."""

    def __init__(self, *, inner_pid: int | None = None, mount_proc: bool = True) -> None:
        reason = pidns_unavailable_reason()
        if reason:
            raise RuntimeError(f"cannot make a PID namespace: {reason}")
        if inner_pid is not None and inner_pid < 3:
            raise ValueError(f"inner_pid must be >= 3 (1 is the namespace's init, 2 the "
                             f"default), got {inner_pid}")
        if inner_pid is not None and not mount_proc:
            raise ValueError("inner_pid needs mount_proc=True (ns_last_pid of the new "
                             "namespace is reached through its own /proc)")
        cmd = ["unshare", "--pid", "--fork", "--kill-child"]
        if mount_proc:
            cmd.append("--mount-proc")
        cmd += [sys.executable, "-c", _BOOT, str(inner_pid or 0)]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, bufsize=1)
        self.real_pid = 0
        self.ns_pid = 0
        try:
            hello = self._read(START_TIMEOUT_S)
            self.ns_pid = hello["pid"]
            self.real_pid = self._find_real_pid()
        except BaseException:
            self.close()
            raise

    def eval(self, expr: str):
        """Value of expression ``expr`` evaluated inside (must be JSON-serialisable)."""
        return self._call("eval", expr)

    def run(self, code: str) -> None:
        """Execute statements inside (dedented); their names stay for later calls."""
        self._call("exec", textwrap.dedent(code))

    def close(self) -> None:
        """End the namespace: EOF to the server, then SIGKILL to unshare (whose child,
        the init, takes every process inside with it). Idempotent."""
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()

    def __enter__(self) -> PidNamespace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------
    def _call(self, op: str, code: str):
        if self._proc is None:
            raise RuntimeError("the PID namespace is closed")
        self._proc.stdin.write(json.dumps({"op": op, "code": code}) + "\n")
        self._proc.stdin.flush()
        reply = self._read(None)
        if not reply["ok"]:
            raise RuntimeError(f"in the PID namespace:\n{reply['error']}")
        return reply["value"]

    def _read(self, timeout: float | None) -> dict:
        if timeout is not None:
            ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
            if not ready:
                raise RuntimeError(f"the process in the PID namespace did not answer within "
                                   f"{timeout} s")
        line = self._proc.stdout.readline()
        if not line:
            code = self._proc.poll()
            raise RuntimeError(f"the process in the PID namespace exited (status {code})")
        return json.loads(line)

    def _find_real_pid(self) -> int:
        for child in psutil.Process(self._proc.pid).children(recursive=True):
            try:
                chain = ns_pids(child.pid)
            except OSError:
                continue
            if len(chain) >= 2 and chain[-1] == self.ns_pid and chain[0] == child.pid:
                return child.pid
        raise RuntimeError(f"no process with pid {self.ns_pid} inside the namespace found "
                           f"under unshare ({self._proc.pid})")
