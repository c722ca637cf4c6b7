"""The bench's scheduler loop (mptier.bench.scheduler.drive) against a scripted design:
lookups asked again until answered, the answer time, and with ``await_lookups`` no load
before its keys are answered. The real designs run through it in test_bench.py."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import pytest

from mptier.bench.base import Design
from mptier.bench.measure import SchedulerLoad
from mptier.bench.scheduler import StallError, answered, drive, hit

LIGHT = SchedulerLoad(work_ns=0, wait_ns=0)


class Answer(enum.Enum):  # the shape of mptier's and vLLM's LookupResult
    HIT = "hit"
    MISS = "miss"
    RETRY = "retry"


@dataclass
class Job:
    job_id: int
    keys: list[bytes]


@dataclass
class Finished:
    job_id: int
    success: bool = True


class Scripted(Design):
    """Answers a key ``answer_after`` steps (``on_schedule_end`` calls) after it was first
    asked for, finishes a job ``finish_after`` steps after its submit, and keeps a log of
    what the scheduler did when."""

    def __init__(self, answer_after: int = 2, finish_after: int = 1,
                 missing: frozenset[bytes] = frozenset(), never_answer: bool = False) -> None:
        super().__init__("scripted")
        self.answer_after, self.finish_after = answer_after, finish_after
        self.missing, self.never_answer = missing, never_answer
        self.steps = 0
        self.asked: dict[bytes, int] = {}  # key -> step of the first question
        self.answered: dict[bytes, int] = {}  # key -> step it was first answered
        self.submitted: dict[int, int] = {}  # job id -> step
        self.running: dict[int, int] = {}  # job id -> step it finishes
        self.keys_of: dict[int, list[bytes]] = {}
        self.most_outstanding = 0  # jobs submitted or asked for and not done, at once

    def _outstanding(self) -> int:
        asking = {k for k in self.asked if k not in self.answered}
        waiting = sum(1 for keys in self.keys_of.values() if set(keys) & asking)
        return len(self.running) + waiting

    def lookup(self, key: bytes, req_id: str) -> Answer:
        self.asked.setdefault(key, self.steps)
        self.keys_of.setdefault(int(req_id[1:]), [])
        if key not in self.keys_of[int(req_id[1:])]:
            self.keys_of[int(req_id[1:])].append(key)
        self.most_outstanding = max(self.most_outstanding, self._outstanding())
        if self.never_answer or self.steps - self.asked[key] < self.answer_after:
            return Answer.RETRY
        self.answered.setdefault(key, self.steps)
        return Answer.MISS if key in self.missing else Answer.HIT

    def submit_load(self, job: Job) -> None:
        self.submitted[job.job_id] = self.steps
        self.running[job.job_id] = self.steps + self.finish_after
        self.most_outstanding = max(self.most_outstanding, self._outstanding())

    def get_finished(self) -> list[Finished]:
        done = [i for i, due in self.running.items() if due <= self.steps]
        for i in done:
            del self.running[i]
        return [Finished(i) for i in done]

    def on_schedule_end(self) -> None:
        self.steps += 1


def jobs(n: int, blocks: int = 3) -> list[tuple[Job, int]]:
    return [(Job(i, [f"k{i}.{b}".encode() for b in range(blocks)]), blocks) for i in range(n)]


def test_the_answer_predicates_know_every_design_s_answers():
    assert not answered(None) and not answered(Answer.RETRY)
    assert answered(True) and answered(False) and answered(Answer.MISS)
    assert hit(True) and hit(Answer.HIT)
    assert not hit(False) and not hit(Answer.MISS)


def test_loads_beside_their_lookups_are_submitted_at_once_and_answers_timed():
    design = Scripted(answer_after=3, finish_after=1)
    stats = drive(design, jobs(6), "load", 2, LIGHT, True, 5.0)
    assert stats.failed == 0 and stats.ok_bytes == 18
    assert len(stats.answer_ns) == 6
    assert len(stats.lookup_ns) == 18  # first questions only, one per key
    for job_id, step in design.submitted.items():  # submitted before any key answered
        assert all(design.answered[k] > step for k in design.keys_of[job_id])
    # the phase ran on until the last job's answers came in, after its load finished
    assert max(design.answered.values()) >= max(design.submitted.values()) + 3


def test_awaited_lookups_hold_each_load_until_every_key_is_answered():
    design = Scripted(answer_after=2, finish_after=1)
    stats = drive(design, jobs(8), "load", 3, LIGHT, True, 5.0, await_lookups=True)
    assert stats.failed == 0 and stats.ok_bytes == 24
    assert len(stats.answer_ns) == 8
    assert sorted(design.submitted) == list(range(8))
    for job_id, step in design.submitted.items():
        assert max(design.answered[k] for k in design.keys_of[job_id]) <= step
    # a job waiting for its answers holds one of the places in flight
    assert design.most_outstanding == 3
    # answers take answer_after steps: the awaited phase is longer than the one beside
    beside = Scripted(answer_after=2, finish_after=1)
    drive(beside, jobs(8), "load", 3, LIGHT, True, 5.0)
    assert beside.steps < design.steps


def test_keys_answered_absent_are_counted():
    keys = jobs(4)
    design = Scripted(answer_after=1, missing=frozenset({keys[1][0].keys[2],
                                                        keys[3][0].keys[0]}))
    stats = drive(design, keys, "load", 2, LIGHT, True, 5.0, await_lookups=True)
    assert stats.lookup_misses == 2 and len(stats.answer_ns) == 4


def test_without_lookups_nothing_is_asked():
    design = Scripted()
    stats = drive(design, jobs(4), "load", 2, LIGHT, False, 5.0, await_lookups=True)
    assert design.asked == {} and stats.answer_ns == [] and stats.ok_bytes == 12


@pytest.mark.parametrize("await_lookups", [False, True])
def test_lookups_never_answered_stall_the_phase_with_a_reason(await_lookups):
    design = Scripted(never_answer=True)
    with pytest.raises(StallError, match="no lookup was answered"):
        drive(design, jobs(2), "load", 2, SchedulerLoad(work_ns=0, wait_ns=1_000_000),
              True, 0.2, await_lookups=await_lookups)
