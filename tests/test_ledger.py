"""The job ledger alone: grouping, first-report-wins, partial loads, shutdown sweep."""

from __future__ import annotations

import errno

from mptier.jobs import LookupResult, Message, MessageType, TaskKind
from mptier.ledger import TASK_INDEX_BITS, JobLedger
from mptier.lookup import LookupTable

KEYS = [bytes([i]) * 36 for i in range(10)]


def done(task_id: int, n_done: int, err: int = 0) -> Message:
    return Message(MessageType.DONE, 0, 1, errno=err, n_done=n_done, task_id=task_id,
                   started_ns=10, elapsed_ns=5)


def test_job_finishes_with_its_last_task_and_twins_are_ignored():
    ledger = JobLedger(4096, LookupTable(), stored_events=True)
    first = ledger.add_job(7, TaskKind.STORE, KEYS, per_task=4)  # tasks of 4, 4, 2
    assert first >> TASK_INDEX_BITS == 1 and ledger.tasks_in_flight == 3
    ledger.task_finished(done(first + 2, 2))
    ledger.task_finished(done(first, 4))
    ledger.task_finished(done(first, 4))  # a retried store's twin
    assert ledger.finished == [] and ledger.tasks_in_flight == 1
    ledger.task_finished(done(first + 1, 4))
    (result,) = ledger.finished
    assert result.job_id == 7 and result.success and result.transfer_bytes == 10 * 4096
    assert [e.kind for e in ledger.events] == ["stored"]
    ledger.task_finished(done(first + 1, 4))  # late report of a finished job
    assert len(ledger.finished) == 1 and not ledger.jobs and not ledger.groups


def test_partial_load_reports_loaded_keys_and_marks_the_rest_missed():
    lookups = LookupTable()
    for key in KEYS[:4]:
        lookups.lookup(key, "r")
    lookups.answer(KEYS[:4], [True] * 4)
    ledger = JobLedger(4096, lookups, stored_events=False)
    first = ledger.add_job(1, TaskKind.LOAD, KEYS[:4], per_task=2)
    ledger.task_finished(done(first, 1, err=errno.ENODATA))  # block 1 short: deleted
    ledger.task_finished(done(first + 1, 2))
    (result,) = ledger.finished
    assert not result.success and result.errno == errno.ENODATA
    assert result.successful_keys == (KEYS[0], KEYS[2], KEYS[3])
    assert [lookups.lookup(k, "r") for k in KEYS[:4]] == [
        LookupResult.HIT, LookupResult.MISS, LookupResult.HIT, LookupResult.HIT]
    assert [(e.kind, e.keys) for e in ledger.events] == [("removed", (KEYS[1],))]


def test_empty_job_finishes_at_once_and_sweep_fails_the_rest():
    ledger = JobLedger(4096, LookupTable(), stored_events=False)
    assert ledger.add_job(1, TaskKind.STORE, [], per_task=4) == 0
    assert ledger.finished[0].success
    first = ledger.add_job(2, TaskKind.STORE, KEYS, per_task=5)
    ledger.task_finished(done(first, 5))
    for task_id in ledger.unfinished_task_ids():
        ledger.fail_task(task_id, errno.ECANCELED, "shut down")
    result = ledger.finished[-1]
    assert result.job_id == 2 and not result.success and result.errno == errno.ECANCELED
    assert result.successful_keys is None  # stores never report partial keys
    assert ledger.counters.jobs_failed["store"] == 1
