"""``mptier bench`` end to end on tiny sizes: every design, every figure, consistent
ratios, and a corrupted block caught by the byte-for-byte check. No speed assertions."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from mptier import fskind
from mptier.bench import cleanup, cli, harness
from mptier.bench.designs import parse_designs, parse_spec
from mptier.bench.engine import MptierDesign, config_overrides
from mptier.bench.measure import CacheDrop, parse_size, spin
from mptier.bench.report import FIGURE_KEYS, fmt
from mptier.bench.saturation import Saturation, device_counters, saturation_figures

TINY = ["--block-bytes", "64K", "--job-blocks", "4", "--inflight-jobs", "4",
        "--total-bytes", "2M", "--single-job-blocks", "8", "--repeats", "1",
        "--idle-seconds", "0.05", "--poll-us", "200", "--busy-work-us", "200", "--no-progress"]

# Bytes in flight are the requests' summed times over the stretch times their mean size:
# where the kernel cut one read into requests of unequal sizes, a mean can overstate a
# lone read's bytes in flight a little; never by this much.
IN_FLIGHT_SLACK = 1.5
# Figures a job-driven design (a, b, c) fills only where a block device holds the root.
DISK_FIGURES = {"store_disk_busy", "load_disk_busy", "single_load_disk_busy",
                "store_disk_mib", "load_disk_mib", "single_load_disk_mib"}
# Figures a job-driven design (a, b, c) must fill; (d) has only these three kinds.
RAW_FIGURES = {"store_gbps", "load_gbps", "store_gbps_busy", "load_gbps_busy",
               "interference", "interference_store", "interference_load"}


def job_designs() -> list[str]:
    designs = ["baseline", "pool-native"]
    if MptierDesign.available() is None:
        designs.insert(0, "mptier:workers=1+1:prefault=0")
    return designs


@pytest.fixture
def fake_drop(monkeypatch) -> list[int]:
    """Record page-cache drops instead of dropping the whole machine's cache."""
    calls: list[int] = []

    def drop() -> CacheDrop:
        calls.append(1)
        return CacheDrop(True)

    monkeypatch.setattr(harness, "drop_page_cache", drop)
    return calls


def run_bench(tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "out.json"
    rc = cli.main(["--root", str(tmp_path), *TINY, "--json", str(out), *extra])
    return rc, json.loads(out.read_text())


@pytest.mark.slow
def test_every_design_reports_every_figure_with_consistent_ratios(tmp_path, fake_drop,
                                                                  capsys):
    designs = [*job_designs(), "raw:tool=loop"]
    png, md = tmp_path / "chart.png", tmp_path / "table.md"
    rc, doc = run_bench(tmp_path, "--designs", ",".join(designs), "--plot", str(png),
                        "--markdown", str(md))
    assert rc == 0, doc["cases"][0]["problems"]
    (case,) = doc["cases"]
    assert case["problems"] == []
    assert case["page_cache_dropped"] is True
    assert fake_drop, "the page cache was never dropped"
    assert [r["label"] for r in case["designs"]] == designs
    assert case["reference_b"] == "baseline" and case["reference_d"] == "raw:tool=loop"

    records = {r["label"]: r for r in case["designs"]}
    b, d = records["baseline"], records["raw:tool=loop"]
    for r in case["designs"]:
        assert r["error"] is None, r
        assert set(r["figures"]) == set(FIGURE_KEYS)
        assert set(r["ratio_to_b"]) == set(FIGURE_KEYS) == set(r["ratio_to_d"])
        filled = {k for k, v in r["figures"].items() if v is not None}
        want = RAW_FIGURES if r["letter"] == "d" else set(FIGURE_KEYS)
        if device_counters(str(tmp_path)) is None:  # no device under the root to count
            want -= DISK_FIGURES
        assert filled == want, (r["label"], want - filled, filled - want)
        for key in FIGURE_KEYS:
            for ref, ratios in ((b, r["ratio_to_b"]), (d, r["ratio_to_d"])):
                value, base = r["figures"][key], ref["figures"][key]
                if value is None or not base:
                    assert ratios[key] is None
                else:
                    assert math.isclose(ratios[key], value / base)
        if r["letter"] != "d":
            assert r["verify"]["ok"] and r["verify"]["blocks_checked"] == 32
            assert r["single_verify"]["ok"]
            assert r["jobs"]["store"] == {"jobs": 8, "failed": 0, "duplicates": 0,
                                          "bytes_ok": 2 << 20, "lookup_misses": 0,
                                          "first_failure": ""}
            assert r["jobs"]["load"]["lookup_misses"] == 0
    assert all(v == 1.0 for v in b["ratio_to_b"].values() if v is not None)
    assert all(v == 1.0 for v in d["ratio_to_d"].values() if v is not None)
    if importlib.util.find_spec("matplotlib") is not None:  # the vLLM env has no charts
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not png.exists()
    assert "baseline" in md.read_text()
    summary = md.read_text().split("## Summary", 1)[1].split("\n\n", 2)[1].splitlines()
    assert summary[0].endswith("| lookups answered p50 ms |")
    for row in summary[2:]:  # every job-driven design's answer time, not the raw loop's
        last = row.rstrip(" |").rsplit("|", 1)[1].strip()
        assert (last == "—") == ("raw:tool=loop" in row), row
    assert "store throughput" in capsys.readouterr().out
    assert not list(tmp_path.glob("mptier-bench-*")), "design folders left behind"


def test_corrupted_block_fails_verification(tmp_path, fake_drop):
    rc, doc = run_bench(tmp_path, "--designs", "baseline", "--inject-corruption", "2")
    assert rc == 1
    (record,) = doc["cases"][0]["designs"]
    assert record["corrupted_files"] == 2
    assert record["verify"]["ok"] is False
    assert record["verify"]["mismatched"] == 2
    assert record["jobs"]["load"]["failed"] == 0  # the loads "succeeded": only bytes tell
    assert any("differ" in p for p in doc["cases"][0]["problems"])


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_failed_jobs_name_their_cause_in_the_last_lines(tmp_path, fake_drop, capsys):
    """A run whose stores fail (a 256 KiB file system for 2 MiB of blocks) exits 1 and
    its last lines say why: the errno and the tier's own text of the first failure."""
    full = tmp_path / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(full)],
                   check=True)
    try:
        out = tmp_path / "out.json"
        design = job_designs()[0]
        rc = cli.main(["--root", str(full), *TINY, "--json", str(out), "--designs", design])
    finally:
        subprocess.run(["umount", "-l", str(full)], check=True)
    assert rc == 1
    problems = json.loads(out.read_text())["cases"][0]["problems"]
    assert any("store job(s) failed" in p and "Errno 28" in p for p in problems), problems
    err = capsys.readouterr().err.strip().splitlines()
    failed = [line for line in err if line.startswith("mptier bench: FAILED:")]
    assert failed and err[-len(failed):] == failed, "the failures come last"
    assert all("the first failure: job" in line for line in failed if "job(s)" in line)
    assert any("No space left on device" in line for line in failed), failed


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_fio_raw_limit(tmp_path, fake_drop):
    rc, doc = run_bench(tmp_path, "--designs", "baseline,raw:tool=fio")
    assert rc == 0, doc["cases"][0]["problems"]
    raw = doc["cases"][0]["designs"][1]
    assert raw["info"]["tool"] == "fio" and raw["info"]["files"] == 32
    assert raw["figures"]["store_gbps"] > 0 and raw["figures"]["load_gbps"] > 0


def test_rounds_report_medians(tmp_path, fake_drop):
    rc, doc = run_bench(tmp_path, "--designs", "baseline", "--rounds", "2")
    assert rc == 0
    (record,) = doc["cases"][0]["designs"]
    assert len(record["rounds"]) == 2
    assert record["jobs"]["store"]["jobs"] == 16
    values = sorted(r["store_gbps"] for r in record["rounds"])
    assert math.isclose(record["figures"]["store_gbps"], sum(values) / 2)

    md = tmp_path / "again.md"  # re-render the run's tables without measuring again
    assert cli.main(["--render", str(tmp_path / "out.json"), "--markdown", str(md)]) == 0
    assert "## Summary" in md.read_text() and "baseline" in md.read_text()


def test_design_specs():
    assert [s.label for s in parse_designs(["a,b", "c d", "mptier:nice=19"])] == [
        "mptier", "baseline", "pool-native", "raw", "mptier:nice=19"]
    assert parse_spec("raw-loop").label == "raw:tool=loop"
    assert parse_spec("b:threads=4+4").build().n_load == 4
    for bad in ("nosuch", "mptier:nice", "baseline:threads=x", "baseline:colour=red"):
        with pytest.raises(ValueError):
            parse_spec(bad).build()
    assert config_overrides({"workers": "2+3", "nice": "19", "cpus": "1-2",
                             "task_bytes": "8M", "native": "0"}) == {
        "n_load_workers": 2, "n_store_workers": 3, "worker_nice": 19,
        "worker_cpus": [1, 2], "task_bytes": "8M", "native": False}


def test_a_twin_is_the_same_design_under_its_own_label():
    plain, twin = parse_designs("baseline:threads=4+4,baseline:threads=4+4:twin=1")
    assert twin.label == "baseline:threads=4+4:twin=1" and twin.twin_of == plain
    assert plain.twin_of is None
    built, again = plain.build(), twin.build()  # the design never sees the twin option
    assert (again.n_load, again.label) == (built.n_load, "baseline:threads=4+4:twin=1")
    assert parse_spec("mptier:twin=2").build().info == parse_spec("mptier").build().info
    with pytest.raises(ValueError, match="is not a positive count"):
        parse_spec("mptier:twin=0")
    with pytest.raises(ValueError, match="which --designs does not name; add baseline"):
        parse_designs("pool-native,baseline:twin=1")


def test_a_twin_run_reports_its_spread_round_by_round(tmp_path, fake_drop, capsys):
    rc, doc = run_bench(tmp_path, "--designs",
                        "baseline,baseline:twin=1,pool-native,pool-native:twin=1",
                        "--rounds", "2", "--no-cold-pass")
    assert rc == 0, doc["cases"][0]["problems"]
    (case,) = doc["cases"]
    plain, twin, native, native_twin = case["designs"]
    assert twin["label"] == "baseline:twin=1" and twin["info"] == plain["info"]
    assert twin["position"] == [1, 2] and plain["position"] == [0, 3]
    entry, native_entry = case["twins"]
    assert (entry["twin"], entry["of"]) == ("baseline:twin=1", "baseline")
    assert (native_entry["twin"], native_entry["of"]) == ("pool-native:twin=1", "pool-native")
    for key, name in (("store_gbps", "store"), ("load_gbps", "load")):
        assert entry[name] == pytest.approx(
            [a[key] / b[key] for a, b in zip(twin["rounds"], plain["rounds"])])
        assert len(entry[name]) == 2
    assert case["reference_b"] == "baseline"  # the twin is never the reference
    # the verdict the run wrote: baseline's family over pool-native's, round by round
    (verdict,) = case["verdicts"]
    assert (verdict["a"], verdict["b"]) == ("baseline", "pool-native")
    for round_no in range(2):
        ratios = sorted(x["rounds"][round_no]["load_gbps"] / y["rounds"][round_no]["load_gbps"]
                        for x in (plain, twin) for y in (native, native_twin))
        assert verdict["load"]["rounds"][round_no] == pytest.approx(
            (ratios[1] + ratios[2]) / 2)
    twin_ratios = entry["load"] + native_entry["load"]
    assert verdict["load"]["band"] == pytest.approx(
        [min(*twin_ratios, *(1 / v for v in twin_ratios)),
         max(*twin_ratios, *(1 / v for v in twin_ratios))])
    assert verdict["load"]["verdict"] in ("ahead", "behind", "not resolved")
    out = capsys.readouterr().out
    assert "A/A control: baseline:twin=1 ÷ baseline, round by round: store " + " ".join(
        f"{v:.2f}" for v in entry["store"]) in out
    assert "A/A verdict: baseline ÷ pool-native (each with its twins), round by round: " \
        f"store {verdict['store']['rounds'][0]:.2f}" in out


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert cli.main(["--root", str(tmp_path), "--designs", "nosuch"]) == 2
    assert cli.main(["--root", str(tmp_path / "missing"), *TINY]) == 2
    assert "unknown design" in capsys.readouterr().err


def test_parse_size():
    assert parse_size("2M") == parse_size("2MiB") == 2 << 20
    assert parse_size("256k") == 256 << 10
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError):
        parse_size("two megs")


def test_cold_pass_and_memory_warm_up_are_recorded(tmp_path, fake_drop):
    rc, doc = run_bench(tmp_path, "--designs", "baseline", "--keep-files")
    assert rc == 0, doc["cases"][0]["problems"]
    (record,) = doc["cases"][0]["designs"]
    figures = record["figures"]
    assert figures["store_cold_gbps"] > 0 and figures["load_cold_gbps"] > 0
    # Each phase's busy part lay between two idle windows; the idle rate is their mean.
    idle = record["idle_rates"]
    assert len(idle) == 4 and all(rate > 0 for rate in idle)
    assert record["idle_loop_rate"] == pytest.approx(sum(idle) / 4)
    assert set(record["busy_seconds"]) == {"store", "load"}
    assert record["cold_verify"]["ok"] and record["cold_verify"]["blocks_checked"] == 32
    # Every phase that writes got 1.25x its bytes of recently freed memory first.
    warm = record["warm_memory"]
    assert {"store_cold", "load_cold", "store", "load", "single"} <= set(warm)
    assert warm["store"]["bytes"] == (2 << 20) * 5 // 4
    assert warm["single"]["bytes"] == 8 * (64 << 10) * 5 // 4
    # The machine's page counters were read around each phase (one small phase may see
    # no allocation machine-wide; the design's phases together always do).
    memory = record["memory"]
    assert {"store", "load"} <= set(memory)
    assert all(isinstance(m["pages_allocated"], int) for m in memory.values())
    assert sum(m["pages_allocated"] for m in memory.values()) > 0
    # On a disk root the cold pass's own files stay until the run ends (here: kept):
    # the cold pass (32), the warm pass (32), the warm-up job (4) and the large job (8).
    (root,) = tmp_path.glob("mptier-bench-*-b")
    cold_kept = 0 if in_memory(tmp_path) else 32
    assert len(list(root.rglob("*.bin"))) == cold_kept + 32 + 4 + 8
    shutil.rmtree(root)
    # With --remove-each (what a memory root always does) they go right after the pass.
    rc, doc = run_bench(tmp_path, "--designs", "baseline", "--keep-files", "--remove-each")
    assert rc == 0 and doc["cases"][0]["removal"] == "kept"
    (root,) = tmp_path.glob("mptier-bench-*-b")
    assert len(list(root.rglob("*.bin"))) == 32 + 4 + 8


class RemovalLog:
    """The order in which the bench made and removed its design folders."""

    def __init__(self, monkeypatch, results=None) -> None:
        self.events: list[tuple[str, str]] = []
        # Whether the run's JSON (``results``) was written by each removal.
        self.results = results
        self.results_written: list[bool] = []
        make, remove = harness.fresh_dir, cleanup.remove_path

        def logged_make(parent: str, name: str) -> str:
            path = make(parent, name)
            self.events.append(("make", path))
            return path

        def logged_remove(path: str) -> None:
            self.events.append(("remove", path))
            if self.results is not None:
                self.results_written.append(self.results.exists())
            remove(path)
        monkeypatch.setattr(harness, "fresh_dir", logged_make)
        monkeypatch.setattr(cleanup, "remove_path", logged_remove)

    def order(self) -> str:
        return "".join(kind[0] for kind, _ in self.events)  # e.g. "mmmmrrrr"

    def paths(self, kind: str) -> list[str]:
        return [path for k, path in self.events if k == kind]


def in_memory(path) -> bool:
    return fskind.fs_magic(str(path)) in fskind.MEMORY_MAGICS


def test_a_disk_root_keeps_every_design_s_files_until_the_run_ends(tmp_path, fake_drop,
                                                                  monkeypatch, capsys):
    """ext4 without a journal creates inodes slowly for a minute after deletions: no
    design stores right after another one's files were removed, in any case of the run.
    The results are written before the removal starts, which reports how far it is."""
    if in_memory(tmp_path):
        pytest.skip(f"{tmp_path} is in memory: the bench removes each design's files there")
    log = RemovalLog(monkeypatch, results=tmp_path / "out.json")
    monkeypatch.setattr(cli, "REMOVAL_REPORT_S", 0.0)  # a line for every folder
    rc, doc = run_bench(tmp_path, "--designs", "baseline,pool-native,raw:tool=loop",
                        "--rounds", "2", "--block-bytes", "64K,128K")
    assert rc == 0, [c["problems"] for c in doc["cases"]]
    assert [c["removal"] for c in doc["cases"]] == ["at the end of the run"] * 2
    assert log.order() == "m" * 12 + "r" * 12
    assert sorted(log.paths("remove")) == sorted(log.paths("make"))
    assert log.results_written == [True] * 12
    err = capsys.readouterr().err
    assert "removing 12 design folder(s) kept on disk" in err
    assert [f"removed {k} of 12 in" in err for k in range(1, 13)] == [True] * 12
    assert not list(tmp_path.glob("mptier-bench-*")), "the run left files behind"


@pytest.mark.parametrize("why", ["--remove-each", "short of room"])
def test_designs_files_go_right_after_each_design_when_asked_or_short_of_room(
        tmp_path, fake_drop, monkeypatch, why):
    """Short of room on a disk, the bench also waits for the device to finish
    discarding what the removal freed before the next design (cleanup.settle)."""
    log = RemovalLog(monkeypatch)
    extra = ["--remove-each"] if why == "--remove-each" else []
    if why == "short of room":  # no root has room for a million designs' files
        monkeypatch.setattr(cleanup, "ROOM_FACTOR", 10 ** 6)
        monkeypatch.setattr(cleanup, "SETTLE_QUIET_S", 0.3)
    settled: list[str] = []
    settle = cleanup.settle

    def logged_settle(root: str, progress) -> None:
        settle(root, lambda line: (settled.append(line), progress(line)))
    monkeypatch.setattr(cleanup, "settle", logged_settle)
    rc, doc = run_bench(tmp_path, "--designs", "baseline,pool-native", "--rounds", "2",
                        *extra)
    assert rc == 0, doc["cases"][0]["problems"]
    assert log.order() == "mr" * 4
    assert not list(tmp_path.glob("mptier-bench-*"))
    on_disk = cleanup.device_discards(str(tmp_path)) is not None
    want = 3 if why == "short of room" and on_disk else 0  # before designs 2, 3 and 4
    assert sum(f"the disk under {tmp_path} settled" in line for line in settled) == want


def test_the_discard_count_is_the_root_s_device_s(tmp_path):
    """A root on a block device reads that device's discard count from /proc/diskstats
    (it moves only forward); one in memory has no device to wait for."""
    assert cleanup.device_discards("/dev/shm") is None
    if in_memory(tmp_path):
        pytest.skip(f"{tmp_path} is in memory")
    dev = os.stat(tmp_path).st_dev
    with open("/proc/diskstats") as f:
        rows = [line.split() for line in f]
    row = next((r for r in rows if (int(r[0]), int(r[1])) == (os.major(dev),
                                                              os.minor(dev))), None)
    if row is None:
        assert cleanup.device_discards(str(tmp_path)) is None
        return
    before = cleanup.device_discards(str(tmp_path))
    assert before is not None and before >= int(row[14])
    assert cleanup.device_discards(str(tmp_path)) >= before


def test_saturation_counts_the_machine_s_cpus_and_the_root_s_device(tmp_path):
    """A phase's saturation figures come from the kernel's counters: CPU time this
    process spends shows in the machine's busy seconds, and a direct read of a file the
    page cache does not hold shows in the device's read bytes and busy time."""
    assert device_counters("/dev/shm") is None
    before = Saturation.take(str(tmp_path))
    spin(300_000_000)
    span = Saturation.take(str(tmp_path)).since(before)
    assert span["cpu_seconds"] >= 0.2, span  # the spin's 0.3 s, in 10 ms ticks
    assert 0.25 <= span["seconds"] < 60
    busy = saturation_figures([span, span])
    assert busy["cpus_busy"] == pytest.approx(span["cpu_seconds"] / span["seconds"])
    assert saturation_figures([])["cpus_busy"] is None
    if in_memory(tmp_path) or device_counters(str(tmp_path)) is None:
        assert "disk_read_bytes" not in span and busy["disk_busy"] is None
        assert busy["disk_read_in_flight"] is None and busy["disk_write_in_flight"] is None
        pytest.skip(f"no block device holds {tmp_path}")
    size = 8 << 20
    path = tmp_path / "blocks.bin"
    path.write_bytes(os.urandom(size))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)  # written, then dropped
        before = Saturation.take(str(tmp_path))
        assert len(os.pread(fd, size, 0)) == size
        span = Saturation.take(str(tmp_path)).since(before)
    finally:
        os.close(fd)
    assert span["disk_read_bytes"] >= size, span
    assert span["disk_busy_seconds"] > 0, span
    assert 0 < saturation_figures([span])["disk_busy"] <= 1.0
    # Little's law: one synchronous reader has at most its read's bytes in flight, and
    # some of them for part of the stretch at least (in however many requests the kernel
    # cut the read into: each counts its bytes and its time).
    assert span["disk_read_requests"] >= 1 and span["disk_read_seconds"] > 0, span
    in_flight = saturation_figures([span])["disk_read_in_flight"]
    assert in_flight is not None and 0 < in_flight <= size * IN_FLIGHT_SLACK, span
    assert saturation_figures([span])["disk_write_in_flight"] is not None


def test_saturation_counts_the_engine_thread_s_waits_for_a_cpu(tmp_path):
    """The thread that takes a phase's saturation is the engine's (it drives the phase):
    sharing its one CPU with a busy process, it waits on a run queue for about half the
    time, and the figures say so. Steal is the host's: present, and never negative."""
    cpu = min(os.sched_getaffinity(0))
    hog = subprocess.Popen([sys.executable, "-c",
                            f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cpu})  # this thread only
        spin(200_000_000)  # the hog is running on that CPU by now
        before = Saturation.take(str(tmp_path))
        spin(400_000_000)
        span = Saturation.take(str(tmp_path)).since(before)
    finally:
        os.sched_setaffinity(0, allowed)
        hog.kill()
        hog.wait()
    # Two runnable tasks of one weight on one CPU: each waits about half the wall time.
    assert 0.1 <= span["waited_seconds"] <= span["seconds"], span
    figures = saturation_figures([span])
    assert figures["waited_ms_per_s"] == pytest.approx(
        span["waited_seconds"] / span["seconds"] * 1e3)
    assert span["steal_seconds"] >= 0 and figures["steal_cpus"] >= 0


def test_memory_roots_remove_each_design_s_files_at_once(tmp_path):
    assert cleanup.removal_rule("/dev/shm") == cleanup.REMOVE_EACH
    assert cleanup.removal_rule(str(tmp_path), defer=False) == cleanup.REMOVE_EACH
    if not in_memory(tmp_path):
        assert cleanup.removal_rule(str(tmp_path)) == cleanup.REMOVE_AT_END


def test_cold_pass_and_warm_up_can_be_switched_off(tmp_path, fake_drop):
    rc, doc = run_bench(tmp_path, "--designs", "baseline", "--no-cold-pass",
                        "--no-warm-memory")
    assert rc == 0
    (record,) = doc["cases"][0]["designs"]
    assert record["figures"]["store_cold_gbps"] is None
    assert record["warm_memory"] is None and record["cold_verify"] is None


def test_rounds_alternate_the_order_of_designs(tmp_path, fake_drop):
    rc, doc = run_bench(tmp_path, "--designs", "baseline,pool-native", "--rounds", "2",
                        "--no-cold-pass")
    assert rc == 0
    b, c = doc["cases"][0]["designs"]
    assert (b["position"], c["position"]) == ([0, 1], [1, 0])


def test_concurrency_sweep_gives_one_case_per_value_and_a_sweep_table(tmp_path, fake_drop,
                                                                       capsys):
    md = tmp_path / "table.md"
    rc, doc = run_bench(tmp_path, "--designs", "baseline,pool-native", "--no-cold-pass",
                        "--inflight-jobs", "1", "--markdown", str(md))
    assert rc == 0
    # TINY asks for 4 in flight, and this run adds 1: two cases, in that order.
    assert [c["workload"]["inflight_jobs"] for c in doc["cases"]] == [4, 1]
    text = md.read_text()
    assert "## Sweep of jobs in flight" in text
    table = text.split("## Sweep of jobs in flight")[1].split("##")[0]
    header, _, *rows = [line for line in table.splitlines() if line.startswith("|")]
    assert header.split("|")[1:-1] == [" design ", " 1 ", " 4 "]
    assert [r.split("|")[1].strip() for r in rows] == ["baseline", "pool-native"]
    for case in doc["cases"]:  # each cell is that case's store / load figure
        col = 2 if case["workload"]["inflight_jobs"] == 1 else 3
        for row, record in zip(rows, case["designs"]):
            store, load = (float(x) for x in row.split("|")[col].split("/"))
            assert math.isclose(store, round(record["figures"]["store_gbps"], 2))
            assert math.isclose(load, round(record["figures"]["load_gbps"], 2))
    assert "Sweep of jobs in flight" in capsys.readouterr().out
    # then load job latency against the same values, and the large job alone (timed in
    # the one-in-flight case)
    table = text.split("## Load job latency against jobs in flight")[1].split("##")[0]
    header, _, *rows = [line for line in table.splitlines() if line.startswith("|")]
    assert header.split("|")[1:-1] == [" design ", " 1 ", " 4 ", " large job alone: load ms "]
    one = next(c for c in doc["cases"] if c["workload"]["inflight_jobs"] == 1)
    for case in doc["cases"]:
        col = 2 if case["workload"]["inflight_jobs"] == 1 else 3
        for row, record in zip(rows, case["designs"]):
            assert row.split("|")[col].strip() == fmt(record["figures"]["load_job_p50_ms"], 1)
    for row, record in zip(rows, one["designs"]):
        assert row.split("|")[4].strip() == fmt(record["figures"]["single_load_ms"], 1)


def test_block_size_sweep_shorthand(tmp_path):
    from mptier.bench.cli import build_parser, workloads
    args = build_parser().parse_args(["--root", str(tmp_path), "--sweep", "block-size",
                                      "--sweep", "concurrency"])
    cases = workloads(args)
    assert sorted({w.block_bytes for w in cases}) == [64 << 10, 128 << 10, 256 << 10,
                                                     512 << 10, 1 << 20, 2 << 20]
    assert sorted({w.inflight_jobs for w in cases}) == [1, 4, 16, 64]
    assert len(cases) == 24


def test_vllm_design_is_skipped_with_a_reason_where_vllm_is_missing(tmp_path, fake_drop):
    from mptier.bench.vllm_tier import VllmTierDesign
    reason = VllmTierDesign.available()
    if reason is None:
        pytest.skip("vLLM is importable here; test_vllm_design_runs covers it")
    rc, doc = run_bench(tmp_path, "--designs", "baseline,vllm", "--no-cold-pass")
    assert rc == 0
    v = doc["cases"][0]["designs"][1]
    assert v["letter"] == "v" and "vllm-env.sh" in v["skipped"]


@pytest.mark.vllm
@pytest.mark.parametrize("lookups", ["await", "beside"])
def test_vllm_design_runs(tmp_path, fake_drop, lookups):
    from mptier.bench.vllm_tier import VllmTierDesign
    if VllmTierDesign.available() is not None:
        pytest.skip(VllmTierDesign.available())
    rc, doc = run_bench(tmp_path, "--designs", "vllm,baseline", "--lookups", lookups)
    assert rc == 0, doc["cases"][0]["problems"]
    case = doc["cases"][0]
    assert case["workload"]["await_lookups"] is (lookups == "await")
    for r in case["designs"]:  # vLLM's RETRY is not taken for an answer, nor a miss
        assert r["jobs"]["load"]["lookup_misses"] == 0
        assert r["figures"]["lookup_answer_ms_p50"] > 0
    v, b = case["designs"]
    assert case["reference_v"] == "vllm"
    assert v["verify"]["ok"] and v["cold_verify"]["ok"] and v["single_verify"]["ok"]
    assert v["jobs"]["load"]["failed"] == 0
    assert {k for k, x in v["figures"].items() if x is None} == set()
    assert math.isclose(b["ratio_to_v"]["store_gbps"],
                        b["figures"]["store_gbps"] / v["figures"]["store_gbps"])
    assert not list(tmp_path.glob("mptier-bench-*")), "design folders left behind"


def test_stored_keys_looked_up_absent_are_a_problem_unless_their_stores_failed():
    from mptier.bench.report import problems
    jobs = {"jobs": 4, "failed": 0, "duplicates": 0, "bytes_ok": 4, "lookup_misses": 0,
            "first_failure": ""}
    record = {"label": "x", "jobs": {"store": dict(jobs),
                                     "load": {**jobs, "lookup_misses": 3}}}
    assert problems({"designs": [record]}) == [
        "x: every key was stored, yet lookups answered 3 of them absent"]
    record["jobs"]["store"].update(failed=1, first_failure="job 2: full")
    assert [p for p in problems({"designs": [record]}) if "absent" in p] == []


def test_the_case_title_says_when_loads_went_beside_their_lookups():
    from mptier.bench.report import case_title
    w = {"root": "/r", "block_bytes": 1 << 20, "job_blocks": 16, "inflight_jobs": 16,
         "total_bytes": 1 << 30}
    case = {"root_fs": "ext4", "o_direct": True}
    assert "beside" not in case_title({**case, "workload": {**w, "await_lookups": True}})
    beside = case_title({**case, "workload": {**w, "await_lookups": False}})
    assert beside.endswith(" · loads beside their lookups")
    # a run from before the choice existed submitted its loads beside their lookups
    assert case_title({**case, "workload": w}) == beside
    args = cli.build_parser().parse_args([])
    assert cli.workloads(args)[0].await_lookups is True  # an engine's order by default


def test_loop_rate_is_taken_against_the_idle_windows_around_its_busy_part():
    from mptier.bench.report import MIN_BUSY_SECONDS, design_record
    from mptier.bench.scheduler import PhaseStats

    def busy(rate: float, seconds: float) -> PhaseStats:
        return PhaseStats(jobs=1, ok_bytes=1, elapsed_ns=int(seconds * 1e9),
                          loop_iterations=int(rate * seconds), loop_ns=int(seconds * 1e9))
    out = {"store": PhaseStats(jobs=1, ok_bytes=1, elapsed_ns=1), "load": PhaseStats(),
           "store_busy": busy(900.0, 2.0), "load_busy": busy(450.0, 0.2),
           "store_idle": [800.0, 1200.0], "load_idle": [500.0, 400.0],
           "idle_rates": [800.0, 1200.0, 500.0, 400.0], "idle_loop_rate": 725.0}
    record = design_record("x", "a", "tier", {}, [], out)
    figures = record["figures"]
    # Each phase against the mean of its own two windows, not the run's mean (725).
    assert figures["interference_store"] == pytest.approx(0.9)
    assert figures["interference_load"] == pytest.approx(1.0)
    assert record["busy_seconds"] == pytest.approx({"store": 2.0, "load": 0.2})
    (note,) = record["notes"]
    assert note.startswith("the busy part of the load phase lasted under "
                           f"{MIN_BUSY_SECONDS:g} s") and "interference_load" in note
    # A record without the windows (an older harness) still uses the one idle rate.
    del out["store_idle"], out["load_idle"]
    figures = design_record("x", "a", "tier", {}, [], out)["figures"]
    assert figures["interference_store"] == pytest.approx(900 / 725)


def test_short_phases_are_flagged():
    from mptier.bench.report import short_phase
    w = {"blocks_per_phase": 256, "job_blocks": 16, "busy_fraction": 0.5,
         "inflight_jobs": 16, "block_bytes": 2 << 20}
    warning = short_phase({"workload": w})
    assert "only 8 jobs" in warning and "--total-bytes 4GiB" in warning
    assert short_phase({"workload": {**w, "blocks_per_phase": 2048}}) is None


def test_checksum_variant_and_crc32c_speed_are_reported(tmp_path, fake_drop, capsys):
    if MptierDesign.available() is not None:
        pytest.skip(MptierDesign.available())
    md = tmp_path / "table.md"
    designs = ["mptier:workers=1+1:prefault=0:checksum=true",
               "mptier:workers=1+1:prefault=0:checksum=false"]
    rc, doc = run_bench(tmp_path, "--designs", ",".join(designs), "--markdown", str(md),
                        "--no-cold-pass")
    assert rc == 0, doc["cases"][0]["problems"]
    crc = doc["crc32c"]
    assert crc["gbps"] > 0 and crc["impl"]
    on, off = (r["figures"] for r in doc["cases"][0]["designs"])
    # The info says what "auto" gave the root (the bench's buffer is 4 KiB pages).
    from mptier.workers.bounce import bounce_stores
    info = doc["cases"][0]["designs"][0]["info"]
    assert info["bounce_stores"] is bounce_stores(str(tmp_path), info["o_direct"], "auto")
    assert isinstance(info["bounce_loads"], bool)
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.startswith("checksums on / off")]
    assert len(lines) == 1 and "mptier:workers=1+1:prefault=0" in lines[0]
    want = f"store x{on['store_gbps'] / off['store_gbps']:.2f}, " \
           f"load x{on['load_gbps'] / off['load_gbps']:.2f}"
    assert lines[0].endswith(want)
    assert "CRC32C on one core" in out and "CRC32C on one core" in md.read_text()
    assert lines[0] in md.read_text()
