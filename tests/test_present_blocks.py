"""A store of blocks already on disk writes nothing (issue 18, item 5): after a partial
hit vLLM stores again blocks it loaded; those files keep their inode and mtime, and the
figures tell bytes written from bytes skipped -- in ``stats()``, in ``mptier status``
and in the Prometheus metrics."""

from __future__ import annotations

import glob
import json
import os
import time

import pytest
from conftest import fill_random, wait_results
from test_monitor_cli import _free_port, _scrape, _status, _value
from test_service import attach, start_service  # noqa: F401  (fixtures)

from mptier import TransferJob, make_key

BLOCK = 64 << 10


def store(tier, job_id: int, keys: list[bytes], slots: list[int]):
    tier.submit_store(TransferJob(job_id, keys, slots))
    result = wait_results(tier, [job_id])[job_id]
    assert result.success, result
    return result


@pytest.mark.parametrize("capacity", [0, 1 << 30], ids=["no-budget", "budget"])
def test_a_store_of_present_blocks_writes_nothing_and_counts_them_skipped(
        make_buffer, make_tier, root, capacity):
    """Without a budget the store itself says which blocks it found (no existence check
    before it); under one a check first keeps them out of the room to make. Both count
    alike."""
    buf = make_buffer(16, BLOCK)
    port = _free_port()
    tier = make_tier(buf, n_load_workers=1, n_store_workers=1, task_bytes=4 * BLOCK,
                     metrics_port=port, capacity_bytes=capacity)
    fill_random(buf.view, range(8), seed=5)
    keys = [make_key(os.urandom(32)) for _ in range(8)]
    store(tier, 1, keys[:3], [0, 1, 2])
    stats = tier.stats()
    assert (stats["written_bytes"], stats["skipped_bytes"]) == (3 * BLOCK, 0)
    files = {k: tier.path_for(k) for k in keys[:3]}
    before = {k: os.stat(p) for k, p in files.items()}
    time.sleep(0.02)  # a rewrite would show in the nanosecond mtime
    # The engine stores them again beside five new ones (tasks of 4: mixed and present).
    result = store(tier, 2, keys, list(range(8)))
    assert result.transfer_bytes == 8 * BLOCK  # the job stored all eight
    for k, path in files.items():
        now = os.stat(path)
        assert (now.st_ino, now.st_mtime_ns, now.st_size) == \
            (before[k].st_ino, before[k].st_mtime_ns, before[k].st_size), path
    assert not glob.glob(f"{root}/**/*.tmp", recursive=True)
    stats = tier.stats()
    assert (stats["written_bytes"], stats["skipped_bytes"]) == (8 * BLOCK, 3 * BLOCK)
    assert stats["bytes_done"]["store"] == 11 * BLOCK  # written + skipped
    # The same two figures in mptier status and in Prometheus.
    code, out, err = _status("--json", "--name", tier.status_name, "--interval", "0")
    assert code == 0, err
    totals = json.loads(out)["totals"]
    assert (totals["written_bytes"], totals["skipped_bytes"]) == (8 * BLOCK, 3 * BLOCK)
    samples = _scrape(port)
    assert _value(samples, "mptier_written_bytes_total") == 8 * BLOCK
    assert _value(samples, "mptier_skipped_bytes_total") == 3 * BLOCK
    # Loads count neither.
    tier.submit_load(TransferJob(3, keys[:2], [10, 11]))
    assert wait_results(tier, [3])[3].success
    stats = tier.stats()
    assert (stats["written_bytes"], stats["skipped_bytes"]) == (8 * BLOCK, 3 * BLOCK)


def test_the_byte_counts_survive_a_worker_replaced(make_buffer, make_tier):
    """The pool's totals never go back: a replaced worker's counts are kept."""
    import signal

    from conftest import wait_for

    buf = make_buffer(8, BLOCK)
    tier = make_tier(buf, n_load_workers=0, n_store_workers=1, task_bytes=BLOCK)
    keys = [make_key(os.urandom(32)) for _ in range(2)]
    store(tier, 1, keys, [0, 1])
    store(tier, 2, keys, [0, 1])
    [worker] = tier.stats()["workers"]
    os.kill(worker["pid"], signal.SIGKILL)
    wait_for(lambda: [w["pid"] for w in tier.stats()["workers"] if w["ready"]] not in
             ([], [worker["pid"]]), 30, "a replacement worker")
    stats = tier.stats()
    assert (stats["written_bytes"], stats["skipped_bytes"]) == (2 * BLOCK, 2 * BLOCK)
    store(tier, 3, keys[:1], [0])
    assert tier.stats()["skipped_bytes"] == 3 * BLOCK


def test_an_engine_attached_to_a_service_reports_the_services_byte_counts(
        start_service, attach, make_buffer, backend):  # noqa: F811
    from conftest import wait_for

    service = start_service("kv", "--set", f"native={backend == 'native'}".lower())
    buf = make_buffer(8, BLOCK)
    fill_random(buf.view, range(4), seed=9)
    tier = attach(service, buf)
    keys = [make_key(os.urandom(32)) for _ in range(4)]
    store(tier, 1, keys[:2], [0, 1])
    store(tier, 2, keys, [0, 1, 2, 3])
    wait_for(lambda: (tier.stats()["written_bytes"], tier.stats()["skipped_bytes"])
             == (4 * BLOCK, 2 * BLOCK), 30, "the service's figures")
    code, out, err = _status("--json", "--name", "kv", "--interval", "0")
    assert code == 0, err
    totals = json.loads(out)["totals"]
    assert (totals["written_bytes"], totals["skipped_bytes"]) == (4 * BLOCK, 2 * BLOCK)
