"""The worker pool as a standalone service, and the engine's link to it.

* :mod:`mptier.service.server` -- ``mptier serve --name NAME``: the pool and its
  supervisor in a process of their own, listening on ``<run dir>/NAME.sock``;
* :mod:`mptier.service.link` -- :class:`ServiceLink`, what a
  ``FileSystemTier(buf, service="NAME")`` uses instead of a pool of its own: the same
  methods as :class:`mptier.workers.WorkerPool`, over the socket.
"""

from __future__ import annotations

from mptier.service.link import ServiceLink
from mptier.service.server import Service, serve

__all__ = ["Service", "ServiceLink", "serve"]
