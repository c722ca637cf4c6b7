"""Where a service named NAME listens: ``<run dir>/NAME.sock``, with ``NAME.lock`` held
by the running service (one service per name). Only checked run folders count
(:mod:`mptier.rundir`)."""

from __future__ import annotations

import os

from mptier.rundir import Trust, check_name, run_dir, scan_dirs, warn_once

SOCKET_SUFFIX = ".sock"
LOCK_SUFFIX = ".lock"


def socket_path(name: str, create: bool = False, trust: Trust | None = None) -> str:
    return os.path.join(run_dir(create, trust), check_name(name) + SOCKET_SUFFIX)


def locate(name: str, trust: Trust | None = None) -> tuple[str, list[str]]:
    """``(the socket of service name, why run folders were skipped)``: the socket in the
    first checked folder clients search that has it (a process that could not write
    /run/mptier serves from /tmp), else where it would be (``""`` when no folder may be
    used). Each skipped folder is logged once, naming its owner and mode."""
    check_name(name)
    folders, refused = scan_dirs(trust)
    for problem in refused:
        warn_once(problem)
    for folder in folders:
        path = os.path.join(folder, name + SOCKET_SUFFIX)
        if os.path.lexists(path):
            return path, refused
    return (os.path.join(folders[0], name + SOCKET_SUFFIX) if folders else ""), refused


def find_socket(name: str, trust: Trust | None = None) -> str:
    """The socket of service ``name`` (see :func:`locate`)."""
    return locate(name, trust)[0]
