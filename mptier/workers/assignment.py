"""The supervisor's part that hands workers their work: the engine's session, and a
caretaker for each of its roots.

A session (:class:`~mptier.workers.session.Session`, the supervisor's own copy of the
engine's descriptors) goes to every ready worker; one that boots later, or whose attach
failed, is offered it again by the tick. Every root of the session gets a caretaker (a
serving worker, store workers first, the fewest roots each), replaced when it dies,
leaves or detaches.
"""

from __future__ import annotations

from mptier.layout import FileMapper
from mptier.pipes import RecordWriter
from mptier.storage.roots import RootRouter
from mptier.workers import protocol
from mptier.workers.session import IoSettings, Session
from mptier.workers.supervised import Phase, SupervisorState, Worker, log


class Assignment(SupervisorState):
    """Sessions and caretakers, handed to workers."""

    def attach(self, session: Session, io: IoSettings) -> int:
        """(Supervisor thread.) Make ``session`` (the supervisor's own copy) current and
        hand it to every ready worker. Returns its id."""
        if self.session is not None:
            self.session.close()
        self.session_id += 1
        self.session = session
        self._reports = RecordWriter(session.completion)
        self._count_waiting()
        self.session_io = io
        with self.lock:
            self.attach_errors = []
        self._mappers = [FileMapper(root, **session.layout) for root in io.root_dirs]
        self._router = RootRouter(io.root_dirs)
        self._caretakers.clear()
        for w in self._live():
            if w.phase is Phase.IDLE:
                self._send_attach(w)
        self._notify()
        return self.session_id

    def end_session(self, ask_workers: bool) -> None:
        """(Supervisor thread.) Forget the current session; with ``ask_workers``, tell
        attached workers to detach (otherwise they detach on the lifeline's end)."""
        if ask_workers:
            for w in self._live():
                if w.phase in (Phase.SERVING, Phase.ATTACHING):
                    self._send(w, protocol.DETACH)
        if self._reports is not None:
            self._flush_reports()  # what fits now; the rest is the engine's to fail
            if self._reports.overflow:
                log.warning("mptier: %d report(s) of tasks given up on were not delivered: "
                            "%s stopped reading its completion pipe and ended its session",
                            len(self._reports.overflow),
                            self.session.label if self.session else "the engine")
        self._reports = None
        self._count_waiting()
        if self.session is not None:
            self.session.close()
        self.session = None
        self._notify()

    def _lifeline_closed(self, session: Session) -> None:
        """The engine closed its lifeline or died: its workers detach by themselves."""
        if session is self.session:
            log.info("mptier: %s ended its session", session.label or "the engine")
            self.end_session(ask_workers=False)

    def _send_attach(self, w: Worker) -> None:
        assert self.session is not None and self.session_io is not None
        description, fds = self.session.to_worker()
        w.phase = Phase.ATTACHING
        w.session_id = self.session_id
        if not self._send(w, protocol.ATTACH, fds, session=description,
                          session_id=self.session_id, io=self.session_io.to_wire()):
            w.phase = Phase.IDLE
            w.session_id = 0

    def ask_to_leave(self) -> None:
        """(Supervisor thread.) Ask every worker to leave."""
        for w in self._live():
            if w.phase is not Phase.LEAVING:
                self._send(w, protocol.EXIT)
                w.phase = Phase.LEAVING
        self._notify()

    def _assign_caretakers(self) -> None:
        """Give every root of the session a caretaker: a serving worker, store workers
        first, the fewest roots each. A caretaker that died, left or detached is
        replaced here (its roots' usage stays published meanwhile)."""
        if self.session is None or self._stopping or not self._mappers:
            return
        serving = [w for w in self._live() if w.phase is Phase.SERVING
                   and w.session_id == self.session_id]
        if not serving:
            return
        load: dict[Worker, int] = {w: 0 for w in serving}
        orphans = []
        for index in range(len(self._mappers)):
            w = self._caretakers.get(index)
            if w is not None and w in load:
                load[w] += 1
            else:
                orphans.append(index)
        if not orphans:
            return
        given: dict[Worker, list[int]] = {}
        for index in orphans:
            w = min(serving, key=lambda c: (load[c], c.role != "store", c.slot))
            load[w] += 1
            self._caretakers[index] = w
            given.setdefault(w, []).append(index)
        for w, indices in given.items():
            if not self._send(w, protocol.CARETAKE, roots=indices):
                for index in indices:
                    self._caretakers.pop(index, None)
