"""mptier.native.entries: the one home of what a task's errno says -- the C core's table
of cases and the failure texts agree with it, the outcome a worker's completion message
carries comes from it, and root health counts exactly its faults. (That the engine
counts by the outcome of real workers' messages: tests/test_integrity.py's checksum
and hostile-entry tests, and tests/test_ledger.py.)"""

from __future__ import annotations

import errno
import pathlib
import re

from mptier import native
from mptier.native import entries
from mptier.workers import health

C_SOURCE = pathlib.Path(native.__file__).parent / "mptier_io.c"


def test_the_c_cores_table_of_cases_names_exactly_these_errnos():
    text = C_SOURCE.read_text()
    table = text[text.index(" *   entry at the path"):text.index("\"Removed\" is done")]
    named = {name for name in re.findall(r"\b(E[A-Z]+)\b", table) if name != "ENOENT"}
    assert {errno.errorcode[e] for e in entries.ENTRY_ERRNOS} == named


def test_the_failure_text_carries_the_tables_meaning():
    for err, entry in entries.ENTRY_ERRNOS.items():
        text = str(native.batch_error("load", err, 0, 0, "blocks/x.bin"))
        assert entry.hint in text and errno.errorcode[err] in text
    store = str(native.batch_error("store", errno.EFBIG, 0, 0, "blocks/x.bin"))
    assert entries.ENTRY_ERRNOS[errno.EFBIG].store_hint in store
    assert entries.hint("load", errno.EIO) == ""


def test_an_errno_means_one_outcome_and_corruption_is_a_loads_finding():
    outcome, Out = entries.outcome, entries.Outcome
    assert outcome("load", 0) == outcome("store", 0) == outcome("lookup", 0) == Out.OK
    for err, entry in entries.ENTRY_ERRNOS.items():
        assert outcome("load", err) == entry.kind
    assert [outcome("store", e) for e in (errno.ENODATA, errno.EBADMSG)] == [Out.OTHER] * 2
    assert outcome("store", errno.ELOOP) == outcome("store", errno.EFBIG) == Out.BAD_ENTRY
    assert outcome("load", errno.ENOENT) == Out.MISSING
    assert outcome("store", errno.ENOSPC) == outcome("store", errno.EDQUOT) == Out.FULL
    assert outcome("store", errno.EROFS) == Out.READ_ONLY
    assert outcome("load", errno.EIO) == outcome("load", errno.ESTALE) == Out.FAULT
    assert outcome("load", errno.EACCES) == outcome("store", errno.EINVAL) == Out.OTHER


def test_root_health_counts_exactly_the_fault_and_read_only_outcomes():
    for err in (*errno.errorcode, *entries.FAULT_ERRNOS):
        counted = entries.outcome("store", err) in (entries.Outcome.FAULT,
                                                   entries.Outcome.READ_ONLY)
        assert health.is_fault(err) == counted, errno.errorcode.get(err, err)
