"""mptier.native.entries: the one table of what a batch call's errno says about the entry
at a block path -- the C core's table of cases, the failure texts and the ledger's
counts all agree with it."""

from __future__ import annotations

import errno
import pathlib
import re

from mptier import ledger, native
from mptier.native import entries

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


def test_the_ledger_counts_by_the_tables_kinds():
    assert {errno.ELOOP, errno.EFBIG, errno.ENOTDIR,
                                       errno.EMEDIUMTYPE} == ledger.BAD_ENTRY_ERRNOS
    assert {errno.ENODATA, errno.EBADMSG} == ledger.CORRUPT_ERRNOS
    assert entries.ENTRY_ERRNOS[errno.EBADMSG].kind == entries.CHECKSUM
