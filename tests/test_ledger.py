"""The job ledger alone: grouping, first-report-wins, partial loads, shutdown sweep."""

from __future__ import annotations

import array
import errno

from mptier.jobs import LookupResult, Message, MessageType, TaskKind, decode_task
from mptier.ledger import LOOKUP_PRESENT, TASK_INDEX_BITS, JobLedger, spread_per_task
from mptier.lookup import LookupTable
from mptier.native.entries import Outcome

KEYS = [bytes([i]) * 36 for i in range(10)]


def ids(keys: list[bytes]) -> array.array:
    return array.array("q", range(100, 100 + len(keys)))


def done(task_id: int, n_done: int, err: int = 0, outcome: Outcome = Outcome.OK) -> Message:
    return Message(MessageType.DONE, 0, 1, errno=err, n_done=n_done, task_id=task_id,
                   started_ns=10, elapsed_ns=5, outcome=outcome)


def test_job_finishes_with_its_last_task_and_twins_are_ignored():
    ledger = JobLedger(4096, LookupTable(), stored_events=True)
    first = ledger.add_job(7, TaskKind.STORE, KEYS, ids(KEYS), per_task=4)  # tasks of 4, 4, 2
    assert first >> TASK_INDEX_BITS == 1 and ledger.tasks_in_flight == 3
    ledger.task_finished(done(first + 2, 2))
    ledger.task_finished(done(first, 4))
    ledger.task_finished(done(first, 4))  # a retried store's twin
    assert ledger.take_finished() == [] and ledger.tasks_in_flight == 1
    ledger.task_finished(done(first + 1, 4))
    (result,) = ledger.take_finished()
    assert result.job_id == 7 and result.success and result.transfer_bytes == 10 * 4096
    assert [e.kind for e in ledger.take_events()] == ["stored"]
    assert ledger.take_events() == []
    ledger.task_finished(done(first + 1, 4))  # late report of a finished job
    assert ledger.take_finished() == [] and not ledger.jobs and not ledger.groups


def test_tasks_in_flight_counts_every_task_until_its_first_report():
    """The count the manager asks at every submit (is a worker idle?) is kept, not
    summed: it must agree with the groups at every step, twins and failures included."""
    lookups = LookupTable()
    for key in KEYS[:3]:
        lookups.lookup(key, "r")
    ledger = JobLedger(4096, lookups, stored_events=False)
    a = ledger.add_job(1, TaskKind.STORE, KEYS, ids(KEYS), per_task=3)  # 4 tasks
    b = ledger.add_lookups(lookups.take_unsent(), per_task=2)  # 2 tasks
    c = ledger.add_job(2, TaskKind.LOAD, KEYS[:4], ids(KEYS[:4]), per_task=4)  # 1 task

    def agrees(expected: int) -> None:
        assert ledger.tasks_in_flight == expected == sum(
            g.left for g in ledger.groups.values())

    agrees(7)
    ledger.task_finished(done(a + 3, 1))
    ledger.task_finished(done(a + 3, 1))  # a twin: counted once
    agrees(6)
    ledger.task_finished(Message(MessageType.DONE, 0, 1, task_id=b, payload=bytes(2)))
    ledger.fail_task(c, errno.EIO, "lost")
    agrees(4)
    for task_id in ledger.unfinished_task_ids():
        ledger.fail_task(task_id, errno.ECANCELED, "shut down")
    agrees(0)
    assert not ledger.groups


def test_a_job_is_spread_over_idle_workers_only_down_to_the_least_task():
    # (blocks, blocks a task, idle workers, least blocks a task) -> blocks a task
    assert spread_per_task(16, 32, 2, 4) == 8  # one task of 32 would leave a worker idle
    assert spread_per_task(16, 32, 4, 4) == 4
    assert spread_per_task(16, 32, 8, 4) == 4  # not below the least: 4 tasks, not 8
    assert spread_per_task(6, 32, 4, 4) == 4  # 2 tasks of 4 and 2
    assert spread_per_task(4, 32, 4, 4) == 32  # no smaller than one least task
    assert spread_per_task(64, 4, 2, 1) == 4  # 16 tasks already: every worker has one
    assert spread_per_task(16, 32, 1, 4) == 32  # one idle worker: nothing to spread to
    assert spread_per_task(16, 2, 4, 4) == 2  # never more a task than task_bytes gives
    for n in range(1, 70):
        for idle in range(2, 6):
            per = spread_per_task(n, 16, idle, 2)
            tasks = -(-n // per)
            assert per <= 16 and (per >= 2 or n <= 2)
            assert tasks <= max(idle, -(-n // 16)), (n, idle, per)


def test_partial_load_reports_loaded_keys_and_marks_the_rest_missed():
    lookups = LookupTable()
    for key in KEYS[:4]:
        lookups.lookup(key, "r")
    lookups.answer(KEYS[:4], [True] * 4)
    ledger = JobLedger(4096, lookups, stored_events=False)
    first = ledger.add_job(1, TaskKind.LOAD, KEYS[:4], ids(KEYS[:4]), per_task=2)
    ledger.task_finished(done(first, 1, errno.ENODATA, Outcome.CORRUPT))  # 1 short: deleted
    ledger.task_finished(done(first + 1, 2))
    (result,) = ledger.take_finished()
    assert not result.success and result.errno == errno.ENODATA
    assert result.successful_keys == (KEYS[0], KEYS[2], KEYS[3])
    assert [lookups.lookup(k, "r") for k in KEYS[:4]] == [
        LookupResult.HIT, LookupResult.MISS, LookupResult.HIT, LookupResult.HIT]
    assert [(e.kind, e.keys) for e in ledger.take_events()] == [("removed", (KEYS[1],))]


def test_the_ledger_counts_by_the_outcome_the_worker_sent_not_by_the_errno():
    """The worker sums up what an errno meant (mptier.native.entries.outcome); the ledger
    reads that, so the same errno under another outcome is counted as that outcome."""
    ledger = JobLedger(4096, LookupTable(), stored_events=False)
    counts = ledger.counters
    first = ledger.add_job(1, TaskKind.LOAD, KEYS[:4], ids(KEYS[:4]), per_task=1)
    ledger.task_finished(done(first, 0, errno.EBADMSG, Outcome.CHECKSUM))
    ledger.task_finished(done(first + 1, 0, errno.ENODATA, Outcome.OTHER))  # not a finding
    ledger.task_finished(done(first + 2, 0, errno.ELOOP, Outcome.BAD_ENTRY))
    ledger.task_finished(done(first + 3, 0, errno.EIO, Outcome.FAULT))
    (result,) = ledger.take_finished()
    assert result.checksum_failed and result.errno == errno.EBADMSG
    assert (counts.corrupt_removed, counts.checksum_failures, counts.bad_entries) == (1, 1, 1)
    assert [(e.keys, e.extra) for e in ledger.take_events()] == [
        ((KEYS[0],), {"reason": "checksum"})]
    # A lost task's report is no finding, whatever its errno (the supervisor's and
    # fail_task's reports say LOST).
    first = ledger.add_job(2, TaskKind.LOAD, KEYS[:1], ids(KEYS[:1]), per_task=1)
    ledger.task_finished(Message(MessageType.LOST, 0, 1, errno=errno.ELOOP, task_id=first,
                                 outcome=Outcome.BAD_ENTRY))  # counted on DONE only
    ledger.fail_task(first, errno.ENODATA, "gone")  # the twin: ignored
    assert (counts.corrupt_removed, counts.bad_entries) == (1, 1)
    assert not ledger.take_finished()[0].success


def test_empty_job_finishes_at_once_and_sweep_fails_the_rest():
    ledger = JobLedger(4096, LookupTable(), stored_events=False)
    assert ledger.add_job(1, TaskKind.STORE, [], ids([]), per_task=4) == 0
    assert ledger.take_finished()[0].success
    first = ledger.add_job(2, TaskKind.STORE, KEYS, ids(KEYS), per_task=5)
    ledger.task_finished(done(first, 5))
    for task_id in ledger.unfinished_task_ids():
        ledger.fail_task(task_id, errno.ECANCELED, "shut down")
    (result,) = ledger.take_finished()
    assert result.job_id == 2 and not result.success and result.errno == errno.ECANCELED
    assert result.successful_keys is None  # stores never report partial keys
    assert ledger.counters.jobs_failed["store"] == 1


def test_lookup_answers_come_from_status_bytes():
    lookups = LookupTable()
    for key in KEYS[:3]:
        lookups.lookup(key, "r")
    ledger = JobLedger(4096, lookups, stored_events=False)
    first = ledger.add_lookups(lookups.take_unsent(), per_task=3)
    present = LOOKUP_PRESENT
    ledger.task_finished(Message(MessageType.DONE, 0, 1, task_id=first,
                                 payload=bytes([present, 0, present + 1])))
    assert [lookups.lookup(k, "r") for k in KEYS[:3]] == [
        LookupResult.HIT, LookupResult.MISS, LookupResult.MISS]
    assert ledger.counters.keys_checked == 3 and ledger.counters.keys_found == 1


def test_fail_group_fails_a_refused_job_at_once():
    ledger = JobLedger(4096, LookupTable(), stored_events=False)
    first = ledger.add_job(3, TaskKind.LOAD, KEYS, ids(KEYS), per_task=4)
    ledger.fail_group(first, errno.EHOSTDOWN, "the pool cannot serve: reason")
    (result,) = ledger.take_finished()
    assert (result.job_id, result.success, result.errno) == (3, False, errno.EHOSTDOWN)
    assert "reason" in result.error and not ledger.jobs and not ledger.groups


def test_a_dead_workers_task_is_retried_only_if_unreported():
    ledger = JobLedger(4096, LookupTable(), stored_events=False)
    first = ledger.add_job(5, TaskKind.LOAD, KEYS[:4], ids(KEYS[:4]), per_task=2)
    kind, record = ledger.retry_record(first + 1, attempt=1)
    task = decode_task(record)
    assert (kind, task.kind, task.task_id, task.attempt) == (TaskKind.LOAD, TaskKind.LOAD,
                                                             first + 1, 1)
    assert task.keys == KEYS[2:4] and task.block_ids == [102, 103]
    ledger.task_finished(done(first, 2))  # its worker sent DONE before it died
    assert ledger.retry_record(first, attempt=1) is None
    ledger.task_finished(done(first + 1, 2))
    assert ledger.retry_record(first + 1, attempt=1) is None  # the job is gone
    assert ledger.take_finished()[0].success
