"""Per-request lookup answers, checked off the scheduler thread in batches.

``lookup(key, req)`` answers from what ``req`` already learned; an unknown key answers
RETRY and joins the next batch, which ``on_schedule_end()`` hands to the workers as
existence-check tasks. When the answers come back every request that asked gets them,
so the same key asked by many requests in one step is checked once. A HIT stays a HIT
for that request until a failed load marks the key a miss.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from mptier.jobs import LookupResult

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_RETRY = LookupResult.RETRY


class LookupTable:
    def __init__(self) -> None:
        self._answers: dict[Hashable, dict[bytes, bool]] = {}
        self._waiting: dict[bytes, set[Hashable]] = {}
        self._unsent: list[bytes] = []

    def lookup(self, key: bytes, req: Hashable) -> LookupResult:
        answers = self._answers.get(req)
        if answers is None:
            answers = self._answers[req] = {}
        else:
            known = answers.get(key)
            if known is not None:
                return _HIT if known else _MISS
        waiters = self._waiting.get(key)
        if waiters is None:
            self._waiting[key] = {req}
            self._unsent.append(key)
        else:
            waiters.add(req)
        return _RETRY

    def take_unsent(self) -> list[bytes]:
        """Keys that must be checked in the next batch."""
        keys, self._unsent = self._unsent, []
        return keys

    def answer(self, keys: Iterable[bytes], exists: Iterable[bool]) -> None:
        for key, found in zip(keys, exists):
            for req in self._waiting.pop(key, ()):
                answers = self._answers.get(req)
                if answers is not None:
                    answers[key] = found

    def mark_miss(self, keys: Iterable[bytes]) -> None:
        """A load of these keys failed: every request that holds a HIT for them now MISSes."""
        keys = list(keys)
        for answers in self._answers.values():
            for key in keys:
                if key in answers:
                    answers[key] = False

    def forget(self, req: Hashable) -> None:
        self._answers.pop(req, None)

    @property
    def requests(self) -> int:
        return len(self._answers)

    @property
    def pending_keys(self) -> int:
        return len(self._waiting)
