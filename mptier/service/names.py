"""Where a service named NAME listens: ``<run dir>/NAME.sock``, with ``NAME.lock`` held
by the running service (one service per name)."""

from __future__ import annotations

import os

from mptier.rundir import check_name, client_dirs, run_dir

SOCKET_SUFFIX = ".sock"
LOCK_SUFFIX = ".lock"


def socket_path(name: str, create: bool = False) -> str:
    return os.path.join(run_dir(create), check_name(name) + SOCKET_SUFFIX)


def lock_path(name: str) -> str:
    return os.path.join(run_dir(True), check_name(name) + LOCK_SUFFIX)


def find_socket(name: str) -> str:
    """The socket of service ``name``: in the run directory, or in another place
    clients look (a process that could not write /run/mptier serves from /tmp)."""
    check_name(name)
    for folder in client_dirs():
        path = os.path.join(folder, name + SOCKET_SUFFIX)
        if os.path.exists(path):
            return path
    return socket_path(name)
