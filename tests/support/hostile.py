"""Another local user, for real: processes that run as a second uid (no passwd entry
needed) and attack the run folder -- squat a folder, listen as an impostor service,
plant symlinks, hold idle connections.

The interpreter of the test environment may sit under a folder only root can enter, so a
child cannot be started as the second uid directly (``Popen(user=...)`` would fail to
exec it). Each script starts as root, imports what it needs from the standard library,
then drops to the second uid for good (``setgroups``, ``setresgid``, ``setresuid``) before
it touches anything: everything it does, the kernel checks as that user.

:class:`Impostor` is a listener in a folder of the second user's that accepts attaches
as ``mptier serve`` would, maps every descriptor it is sent and reports what it got
(bytes of messages, descriptors, bytes of memory it could map) as JSON lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap

HOSTILE_UID = 4242
HOSTILE_GID = 4242

_PRELUDE = """
import encodings.idna, json, mmap, os, resource, select, socket, stat, sys, time  # before the drop
os.setgroups([])
os.setresgid({gid}, {gid}, {gid})
os.setresuid({uid}, {uid}, {uid})
assert os.geteuid() == {uid} and os.getegid() == {gid}
"""


def run_as(code: str, *args: str, uid: int = HOSTILE_UID, gid: int = HOSTILE_GID,
           **popen) -> subprocess.Popen:
    """Start ``code`` (Python, standard library only) as ``uid``/``gid``; ``args`` are
    its ``sys.argv[1:]``. Text pipes for stdin and stdout unless ``popen`` says else."""
    script = _PRELUDE.format(uid=uid, gid=gid) + textwrap.dedent(code)
    popen = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True, **popen}
    return subprocess.Popen([sys.executable, "-I", "-c", script, *args], **popen)


def check_as(code: str, *args: str, timeout: float = 30, **kw) -> str:
    """Run ``code`` as the second user to the end; its stdout (fails on a non-zero
    exit, with its stderr)."""
    proc = run_as(code, *args, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, **kw)
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"second-uid script failed ({proc.returncode}): {err}"
    return out


IMPOSTOR = """
folder, name = sys.argv[1], sys.argv[2]
if not os.path.isdir(folder):
    os.mkdir(folder, 0o755)          # first, as the victim's folder would be made
path = os.path.join(folder, name + ".sock")
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind(path)
os.chmod(path, 0o777)                # anyone may connect: a trap
listener.listen(16)
print(json.dumps({"listening": path}), flush=True)
def take(conn):
    conn.settimeout(5)
    got = {"connections": 1, "message_bytes": 0, "fds": 0, "mapped_bytes": 0}
    try:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 64)
        got["message_bytes"], got["fds"] = len(data), len(fds)
        for fd in fds:
            size = os.fstat(fd).st_size
            if size:
                try:
                    with mmap.mmap(fd, size) as m:   # read-write: dump and poison
                        got["mapped_bytes"] += len(m[:])
                except (OSError, ValueError):
                    pass
            os.close(fd)
    except OSError:
        pass
    conn.close()
    print(json.dumps(got), flush=True)
while True:
    ready, _, _ = select.select([listener, sys.stdin], [], [])
    if listener in ready:
        take(listener.accept()[0])
    elif sys.stdin in ready:         # the test closed our stdin: take what waits, leave
        listener.setblocking(False)
        while True:
            try:
                conn, _ = listener.accept()
            except BlockingIOError:
                break
            conn.setblocking(True)
            take(conn)
        break
os.unlink(path)
"""


class Impostor:
    """A second-uid listener on ``<folder>/<name>.sock`` (``folder`` made by it when
    missing). :meth:`report` sums what every connection gave it; :meth:`stop` ends it."""

    def __init__(self, folder: str, name: str, uid: int = HOSTILE_UID,
                 gid: int = HOSTILE_GID) -> None:
        self.proc = run_as(IMPOSTOR, folder, name, uid=uid, gid=gid,
                           stderr=subprocess.PIPE)
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"impostor did not start: {self.proc.stderr.read()}")
        self.path = json.loads(line)["listening"]
        self.uid = uid
        self._totals = {"connections": 0, "message_bytes": 0, "fds": 0, "mapped_bytes": 0}

    def stop(self) -> dict[str, int]:
        """End it; what it got over its life (idempotent)."""
        if self.proc.stdout.closed:
            return dict(self._totals)
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for line in self.proc.stdout:
            for key, value in json.loads(line).items():
                self._totals[key] += value
        self.proc.stdout.close()
        self.proc.stderr.close()
        return dict(self._totals)

    def __enter__(self) -> Impostor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def public_folder(prefix: str = "mptier-pub-") -> str:
    """A new folder like /tmp (mode 1777, under /tmp, whose parents anyone may search),
    in which the second user makes folders of its own. The caller removes it."""
    import tempfile

    path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    os.chmod(path, 0o1777)
    return path
