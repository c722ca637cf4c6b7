"""The caretaker: the one worker per root that keeps the root in shape between tasks.

The supervisor designates one serving worker per root (``caretake`` message; again when
that worker dies or detaches). The caretaker owns the root's
:class:`~mptier.storage.RootMaintainer` (walk, usage, temp sweep, LRU eviction) and
steps it -- never on the engine's scheduler thread -- ::

    idle (between epoll waits)      a step of MAINT_BUDGET entries every IDLE_GAP_S
    busy (between tasks)            a step every BUSY_GAP_S, or EVICT_GAP_S while the
                                    root is past its high watermark or a store waits
                                    for room, so eviction keeps up under load
    after a complete pass           WALK_REST_S without walking (eviction still runs)

After each step it publishes the root's usage and the walk's position in the control
block (other workers and the engine read them without a message), and reports keys it
evicted from the engine's own block folder as REMOVED messages on the completion pipe.

Other workers' new blocks reach the usage through counters in their slots (sorted
against the published walk position: see ``RootMaintainer.record_other_stores``); other
nodes' stores through the walk only.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mptier.jobs import MessageType, encode_message, pack_keys
from mptier.storage import RootMaintainer
from mptier.workers.control import ROOT_COMPLETE, ROOT_EVICTING, RootState
from mptier.workers.health import is_fault

if TYPE_CHECKING:
    from mptier.workers.worker import WorkerContext

log = logging.getLogger("mptier.workers")

# Directory entries per maintainer step: a step then takes a few milliseconds on a
# local disk (docs/storage.md: step(1000) 16 ms median on 2 loaded cores), short enough
# to sit between tasks without delaying the next one noticeably.
MAINT_BUDGET = 256
# Idle: the gap between steps while a pass walks or eviction runs. 256 entries per 20 ms
# is ~13k entries/s, a fraction of one core; a root of a million files takes ~80 s a pass.
IDLE_GAP_S = 0.02
# Busy (a task after another): a step at least this often, so usage and the sweep go on
# under continuous load...
BUSY_GAP_S = 0.25
# ...and this often while evicting or while a store waits for room (the brief's 50-100
# ms): eviction keeps pace with stores.
EVICT_GAP_S = 0.05
# After a complete pass, no walking for this long (eviction and accounting go on): a
# small root would otherwise be walked over and over. Other nodes' stores are seen this
# much later.
WALK_REST_S = 10.0
# How often a resting or unhealthy root is looked at.
REST_CHECK_S = 0.1
ERROR_BACKOFF_S = 1.0


@dataclass
class _Kept:
    index: int
    path: str
    maintainer: RootMaintainer
    pass_base: int  # published pass ids are pass_base + the maintainer's pass number
    inherited_bytes: int  # usage published before this caretaker (a restart's guess)
    evicted_base: tuple[int, int]
    temps_base: int
    next_at: float = 0.0
    last_at: float = 0.0
    rest_until: float = 0.0
    temps_removed: int = 0
    seen: dict[int, tuple[tuple[int, int], tuple[int, int, int, int]]] = field(
        default_factory=dict)


class Caretaker:
    """The maintainers of the roots one worker was designated for. Not thread-safe:
    the worker's serving thread drives it."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.kept: dict[int, _Kept] = {}
        self.folder = os.path.basename(ctx.roots[0].mapper.blocks_dir)

    def __bool__(self) -> bool:
        return bool(self.kept)

    def take(self, indices: list[int]) -> None:
        """Become the caretaker of these roots (indices into the tier's roots)."""
        ctx = self.ctx
        control = ctx.slot_writer.control
        io = ctx.io
        for index in indices:
            if index in self.kept or not 0 <= index < len(ctx.roots):
                continue
            path = ctx.roots[index].path
            rec = control.root(index)
            maintainer = RootMaintainer(
                path, capacity_bytes=io.capacity_bytes, high_watermark=io.high_watermark,
                low_watermark=io.low_watermark, block_bytes=ctx.block_bytes,
                stale_temp_s=io.stale_temp_s)
            kept = _Kept(index, path, maintainer, pass_base=rec.pass_id + 2,
                         inherited_bytes=rec.usage_bytes,
                         evicted_base=(rec.evicted_blocks, rec.evicted_bytes),
                         temps_base=rec.temps_removed)
            # What workers counted before now is on disk already: this walk finds it.
            for slot in range(control.n_slots):
                st = control.slot_stores(slot, index)
                kept.seen[slot] = ((control.slot_pid(slot), st.pass_id),
                                   (st.ahead_bytes, st.ahead_blocks, st.behind_bytes,
                                    st.behind_blocks))
            self.kept[index] = kept
            self._publish(kept)
            log.debug("mptier: worker pid %d takes care of root %s", os.getpid(), path)

    # -- scheduling --------------------------------------------------------------------

    def wait_s(self, cap: float) -> float:
        """How long an idle worker may sleep before a step is due (at most ``cap``)."""
        if not self.kept:
            return cap
        now = time.monotonic()
        return max(0.0, min(cap, *(k.next_at - now for k in self.kept.values())))

    def run(self, busy: bool) -> None:
        """Step every root that is due. ``busy``: between two tasks (steps are then
        spaced by BUSY_GAP_S, or EVICT_GAP_S while evicting or asked for room)."""
        now = time.monotonic()
        for kept in list(self.kept.values()):
            if busy:
                gap = now - kept.last_at
                if gap < EVICT_GAP_S or (gap < BUSY_GAP_S and not self._urgent(kept)):
                    continue
            elif now < kept.next_at:
                continue
            self._step(kept, now)

    def _urgent(self, kept: _Kept) -> bool:
        if kept.maintainer.evicting:
            return True
        control = self.ctx.slot_writer.control
        return any(control.slot_stores(slot, kept.index).want_free
                   for slot in range(control.n_slots))

    def make_room(self, index: int, nbytes: int, deadline: float) -> bool:
        """(A store of this worker, on a root it takes care of.) Evict until ``nbytes``
        more fit under the capacity, or ``deadline`` (monotonic) passes."""
        kept = self.kept.get(index)
        if kept is None:
            return False
        control = self.ctx.slot_writer.control
        while True:
            if control.usage_bytes(index) + nbytes <= self.ctx.io.capacity_bytes:
                return True
            if time.monotonic() >= deadline:
                return False
            before = kept.maintainer.usage_bytes
            self._step(kept, time.monotonic(), want_free=nbytes)
            if kept.maintainer.usage_bytes >= before and kept.maintainer.complete \
                    and not kept.maintainer.candidates_left:
                time.sleep(0.005)  # nothing to evict until more of a pass is walked

    # -- one step ----------------------------------------------------------------------

    def _step(self, kept: _Kept, now: float, want_free: int = 0) -> None:
        ctx = self.ctx
        writer = ctx.slot_writer
        control = writer.control
        m = kept.maintainer
        state, _, _, retry_at = control.root_health(kept.index)
        kept.last_at = now
        if state == RootState.OUT and time.monotonic_ns() < retry_at:
            kept.next_at = now + REST_CHECK_S  # an operation will probe it, not us
            return
        want = max(want_free, self._collect(kept))
        walking = now >= kept.rest_until or ((m.evicting or want) and not m.candidates_left)
        writer.set_root(kept.index)  # a hang here is blamed on this root
        try:
            report = m.step(MAINT_BUDGET, want_free=want, walk=walking)
        except OSError as exc:
            text = f"walking root {kept.path}: {exc}"
            log.warning("mptier: %s", text)
            if exc.errno is not None and is_fault(exc.errno):
                ctx.report_root(kept.index, False, exc.errno, text)
            kept.next_at = now + ERROR_BACKOFF_S
            return
        finally:
            writer.set_root(None)
        if report.pass_completed:
            kept.rest_until = now + WALK_REST_S
        kept.temps_removed += report.temps_removed
        if report.temps_removed:
            log.info("mptier: removed %d stale temporary file(s) under %s",
                     report.temps_removed, kept.path)
        self._publish(kept)
        active = walking or m.evicting
        kept.next_at = now + (IDLE_GAP_S if active else REST_CHECK_S)
        own = [key for folder, key in report.removed if folder == self.folder]
        if own:
            self._send_removed(own)

    def _collect(self, kept: _Kept) -> int:
        """Account other workers' (and this one's) new blocks since the last step;
        returns the most bytes any of them waits to find room for."""
        control = self.ctx.slot_writer.control
        index = kept.index
        m = kept.maintainer
        want = 0
        for slot in range(control.n_slots):
            st = control.slot_stores(slot, index)
            want = max(want, st.want_free)
            who = (control.slot_pid(slot), st.pass_id)
            values = (st.ahead_bytes, st.ahead_blocks, st.behind_bytes, st.behind_blocks)
            before = kept.seen.get(slot)
            base = before[1] if before is not None and before[0] == who else (0, 0, 0, 0)
            delta = [v - b for v, b in zip(values, base)]
            kept.seen[slot] = (who, values)
            if any(delta) and who[0]:
                m.record_other_stores(st.pass_id - kept.pass_base, self.folder,
                                      (delta[0], delta[1]), (delta[2], delta[3]))
        return want

    def _publish(self, kept: _Kept) -> None:
        m = kept.maintainer
        usage = m.tracker.usage
        usage_bytes = usage.bytes if m.complete else max(usage.bytes, kept.inherited_bytes)
        flags = (ROOT_COMPLETE if m.complete else 0) | (ROOT_EVICTING if m.evicting else 0)
        self.ctx.slot_writer.control.set_root_usage(
            kept.index, usage_bytes=usage_bytes, usage_blocks=usage.blocks,
            evicted_blocks=kept.evicted_base[0] + m.evicted_blocks,
            evicted_bytes=kept.evicted_base[1] + m.evicted_bytes,
            temps_removed=kept.temps_base + kept.temps_removed,
            pass_id=kept.pass_base + m.pass_id, top_position=m.top_position(self.folder),
            flags=flags, caretaker_pid=os.getpid())

    def _send_removed(self, keys: list[bytes]) -> None:
        ctx = self.ctx
        writer = ctx.slot_writer
        for payload, count in pack_keys(keys):
            message = encode_message(MessageType.REMOVED, writer.slot, os.getpid(),
                                     n_done=count, payload=payload)
            try:
                os.write(ctx.completion_fd, message)
            except OSError:
                return  # the engine is gone; serve() finds out at its next write
            writer.message_sent()
