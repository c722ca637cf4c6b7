"""What the vLLM plug-in needs of the vLLM it runs in: a release it was checked against
(else an ``ImportError`` naming what to install), the names that differ between
releases, and a place in vLLM's log for mptier's records.

Importing this module imports no vLLM; :mod:`mptier.integrations.vllm_options` (which
the plug-in imports first) refuses an older vLLM by its version
(:func:`check_vllm_release`), and it and :mod:`mptier.integrations.vllm` import vLLM's
classes themselves and raise :func:`unsupported_vllm`'s message when they cannot.
"""

from __future__ import annotations

import logging
import re

# The vLLM releases this plug-in was checked against (its tests run on both).
SUPPORTED_VLLM = ("0.32", "0.33")


def _installed_vllm_version() -> str:
    """The installed vLLM's version as its distribution says (``vllm`` or the CPU build
    ``vllm-cpu``), read without importing vLLM; "not installed" without one."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def unsupported_vllm(exc: BaseException) -> str:
    return (
        f"mptier.integrations.vllm is the vLLM plug-in of mptier and needs vLLM "
        f"{SUPPORTED_VLLM[0]} to {SUPPORTED_VLLM[-1]} (vllm, or vllm-cpu on a machine "
        f"without a GPU) with tiered KV offloading; the installed vLLM "
        f"({_installed_vllm_version()}) cannot provide it: {exc}. Install one of those "
        "releases in the environment that runs vLLM, e.g. 'pip install vllm==0.33.0' "
        "(scripts/vllm-env.sh and scripts/vllm-cpu-env.sh in the mptier repository make "
        "such environments on a machine without a GPU). The rest of mptier works "
        "without vLLM.")



def _release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string ("0.32.0", "0.33.1.dev4+g1234"), None when
    it does not start with two numbers."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def check_vllm_release() -> None:
    """Refuse a vLLM older than the oldest supported release by its version, before
    any import of it could fail in a way that does not say so (or, worse, pass)."""
    version = _installed_vllm_version()
    release = _release(version)
    oldest = _release(SUPPORTED_VLLM[0])
    if release is not None and oldest is not None and release < oldest:
        raise ImportError(unsupported_vllm(
            f"vLLM {version} is older than {SUPPORTED_VLLM[0]}, the first release whose "
            "secondary-tier interface this plug-in implements"))

# vLLM after 0.33 reports blocks that failed their CRC32C check: a JobResult field the
# tiering manager counts, under a tiering metric the tier declares when its checksums
# are on. vLLM 0.33 has neither. Both are looked up when used, not at import, so the
# installed vLLM is judged by what it has (see
# mptier.integrations.vllm.vllm_reports_checksum_failures()).
CHECKSUM_FLAG = "checksum_failed"
CHECKSUM_METRIC_ATTR = "CHECKSUM_FAILURES"

# vLLM configures only its own logger ("vllm": its handlers, its format, no
# propagation); mptier's records would otherwise end at Python's last-resort handler
# (warnings only, bare) or nowhere. See join_vllm_logging().
VLLM_LOGGER = "vllm"
MPTIER_LOGGER = "mptier"


class _ToVllmLog(logging.Handler):
    """Hands each mptier record to vLLM's logger, as if mptier were a child of it: vLLM's
    handlers, their levels and vLLM's format apply, and they are looked up per record,
    so vLLM reconfiguring its logging later is followed."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(VLLM_LOGGER).handle(record)


def join_vllm_logging() -> bool:
    """Send the ``mptier`` logger's records to vLLM's log, once, unless somebody already
    decided where they go. Returns whether mptier's records now reach vLLM's handlers.

    Joins only when vLLM has configured its logger (it has handlers: not with
    ``VLLM_CONFIGURE_LOGGING=0``) and mptier logging is left alone: the ``mptier``
    logger has no handler and no level of its own, and the root logger has no handler
    (a user who called ``logging.basicConfig`` already gets mptier's records there).
    mptier's level becomes vLLM's (``VLLM_LOGGING_LEVEL``); records still propagate
    to the root logger as before. Idempotent; never raises."""
    ours = logging.getLogger(MPTIER_LOGGER)
    if any(isinstance(h, _ToVllmLog) for h in ours.handlers):
        return True
    vllm_log = logging.getLogger(VLLM_LOGGER)
    if not vllm_log.handlers or ours.handlers or ours.level != logging.NOTSET:
        return False
    if logging.getLogger().handlers:
        return False
    ours.addHandler(_ToVllmLog())
    ours.setLevel(vllm_log.getEffectiveLevel())
    return True
