"""The run directory: where services and tiers put their sockets.

``$MPTIER_RUN_DIR`` when set, else ``/run/mptier`` when it can be created and written,
else ``/tmp/mptier-<uid>`` (created 0700; refused if another user owns it). A container
that shares this folder (a volume) with the engine's container can be attached to and
watched from there.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat

from mptier.errors import ConfigError, MptierError

RUN_DIR_ENV = "MPTIER_RUN_DIR"
SYSTEM_RUN_DIR = "/run/mptier"
# Names become file names in the run directory, and Unix socket paths are short (108
# bytes): letters, digits, ".", "_" and "-", not starting with ".".
MAX_NAME = 64
NAME_RE = re.compile(rf"[A-Za-z0-9_-][A-Za-z0-9._-]{{0,{MAX_NAME - 1}}}")


def run_dir(create: bool = True) -> str:
    """The run directory (see the module docstring); with ``create`` it is made if
    missing. Raises ``MptierError`` naming the path when it cannot be used."""
    chosen = os.environ.get(RUN_DIR_ENV)
    if chosen:
        if create:
            try:
                os.makedirs(chosen, exist_ok=True)
            except OSError as exc:
                raise MptierError(f"{RUN_DIR_ENV}={chosen!r} cannot be created: "
                                  f"{exc.strerror}; point it at a writable folder") from None
        return chosen
    if _usable(SYSTEM_RUN_DIR, create):
        return SYSTEM_RUN_DIR
    fallback = f"/tmp/mptier-{os.getuid()}"
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(fallback, 0o700)
    try:
        st = os.lstat(fallback)
    except FileNotFoundError:
        return fallback
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise MptierError(f"{fallback} is not a folder owned by uid {os.getuid()}; remove "
                          f"it or set {RUN_DIR_ENV} to a folder of your own")
    return fallback


def client_dirs() -> list[str]:
    """Where clients look: ``$MPTIER_RUN_DIR`` alone when set, else each of
    ``/run/mptier`` and ``/tmp/mptier-<uid>`` that exists."""
    chosen = os.environ.get(RUN_DIR_ENV)
    if chosen:
        return [chosen]
    return [d for d in (SYSTEM_RUN_DIR, f"/tmp/mptier-{os.getuid()}") if os.path.isdir(d)]


def _usable(path: str, create: bool) -> bool:
    if create:
        try:
            os.makedirs(path, mode=0o755, exist_ok=True)
        except OSError:
            return False
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def check_name(name: object) -> str:
    """``name`` if it can name a service or endpoint, else ``ConfigError``."""
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
        raise ConfigError(f"name {name!r} is invalid: use letters, digits, '.', '_' and "
                          f"'-' (at most {MAX_NAME} characters, not starting with '.')")
    return name
