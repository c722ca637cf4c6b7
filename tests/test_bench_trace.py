"""The trace bench (``mptier bench --trace``): the simulated caches on streams whose
counts are worked out by hand, the trace reader's errors, and short replays through a
real tier whose counts must add up and whose loaded bytes must all be right."""

from __future__ import annotations

import json
import random

import pytest

from mptier.bench.cli import main as bench_main
from mptier.bench.trace_replay import BlockContent, Replay
from mptier.bench.tracefile import TraceError, footprint_blocks, read_trace
from mptier.bench.tracesim import (
    simulate_belady,
    simulate_lru,
    simulate_two_queue,
    simulate_unbounded,
)

KB = 1 << 10
# One worker of each kind: the replays here are small, and every worker boots in turn.
SMALL_POOL = {"n_load_workers": 1, "n_store_workers": 1, "prefault": False}


# -- the simulators ------------------------------------------------------------------------

def test_lru_and_belady_on_a_cyclic_stream_worked_by_hand():
    # Capacity 2, blocks 1 2 3 asked for in turn three times. LRU always evicts the block
    # asked for next: 0 hits. MIN keeps 1 and 2 and never admits 3 (its next use is the
    # furthest each time): 1 and 2 hit on rounds two and three, 4 hits.
    stream = [[1], [2], [3]] * 3
    lru = simulate_lru(stream, 2)
    belady = simulate_belady(stream, 2)
    unbounded = simulate_unbounded(stream)
    assert (lru.blocks_hit, belady.blocks_hit, unbounded.blocks_hit) == (0, 4, 6)
    for sim in (lru, belady, unbounded):
        assert sim.blocks_requested == 9
        assert sim.blocks_hit + sim.blocks_missed == sim.blocks_requested
        assert sim.blocks_stored == sim.blocks_missed


def test_a_block_held_without_its_parent_is_no_hit():
    # LRU of 2: after [1, 2] the cache is 1 (older), 2; storing 4 evicts 1; the third
    # request misses on 1 at once, so the 2 still held counts for nothing. MIN keeps
    # 1 and 2 (4 is never used again and is not admitted): both hit.
    stream = [[1, 2], [4], [1, 2]]
    tokens = [[512, 100], [512], [512, 100]]
    lru = simulate_lru(stream, 2, tokens)
    belady = simulate_belady(stream, 2, tokens)
    assert (lru.blocks_hit, lru.blocks_stored, lru.tokens_hit) == (0, 5, 0)
    assert (belady.blocks_hit, belady.blocks_stored, belady.tokens_hit) == (2, 3, 612)
    assert lru.tokens_requested == belady.tokens_requested == 1736
    assert belady.token_hit_ratio == pytest.approx(612 / 1736)


def test_two_queue_keeps_a_used_block_that_lru_lets_go_worked_by_hand():
    # Capacity 4: 1 and 2 stored, 1 hit (used), 3 and 4 stored: full. LRU then evicts
    # 2 for 5 and 1 for 6, so the last [1] misses. Two-queue evicts the oldest
    # never-used blocks while they are more than half: 2, then 3; the last [1] hits.
    stream = [[1, 2], [1], [3], [4], [5], [6], [1]]
    assert simulate_lru(stream, 4).blocks_hit == 1
    assert simulate_two_queue(stream, 4).blocks_hit == 2
    # Capacity 3, the ghost: 1 evicted for 4, then stored again at once: it enters the
    # used order, so 5, 6 and 7 push out 3, 4 and 5 instead and the last [1] hits; LRU
    # (and two-queue without the ghost) let it go at 7.
    stream = [[1], [2], [3], [4], [1], [5], [6], [7], [1]]
    assert simulate_lru(stream, 3).blocks_hit == 0
    tq = simulate_two_queue(stream, 3)
    assert (tq.blocks_hit, tq.blocks_stored, tq.policy) == (1, 8, "two-queue")


def test_lru_keeps_the_recently_used_prefix():
    # LRU of 3: [1, 2] then [1, 3] (1 used again, 3 stored: 2 is now the oldest) then
    # [5] evicts 2, then [1, 3] hits both and [1, 2] hits only 1.
    stream = [[1, 2], [1, 3], [5], [1, 3], [1, 2]]
    lru = simulate_lru(stream, 3)
    assert lru.blocks_hit == 1 + 2 + 1
    assert lru.blocks_stored == 2 + 1 + 1 + 0 + 1


def _prefix_trace(n_requests: int, seed: int) -> list[list[int]]:
    """Requests that extend earlier conversations, as a chat trace does: each id always
    has the same parent (a prefix tree), a shared first block, new ids counted up."""
    rng = random.Random(seed)
    conversations: list[list[int]] = []
    next_id = 1
    out = []
    for _ in range(n_requests):
        if conversations and rng.random() < 0.7:
            base = list(rng.choice(conversations))
            base = base[:rng.randint(1, len(base))]
        else:
            base = [0]
        grow = rng.randint(1, 5)
        ids = base + list(range(next_id, next_id + grow))
        next_id += grow
        conversations.append(ids)
        out.append(ids)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_belady_is_at_least_lru_and_neither_passes_an_unbounded_cache(seed):
    stream = _prefix_trace(300, seed)
    footprint = len({b for ids in stream for b in ids})
    unbounded = simulate_unbounded(stream)
    for capacity in (1, 5, 20, 60):
        lru = simulate_lru(stream, capacity)
        belady = simulate_belady(stream, capacity)
        assert lru.blocks_hit <= belady.blocks_hit <= unbounded.blocks_hit
    assert simulate_belady(stream, 10).blocks_hit > simulate_lru(stream, 10).blocks_hit
    # Room for everything: both are the unbounded cache.
    assert simulate_lru(stream, footprint).blocks_hit == unbounded.blocks_hit
    assert simulate_belady(stream, footprint).blocks_hit == unbounded.blocks_hit
    assert simulate_lru(stream, 0).blocks_hit == simulate_belady(stream, 0).blocks_hit == 0


# -- the trace reader ----------------------------------------------------------------------

GOOD = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}'


@pytest.mark.parametrize("line, names", [
    ("{not json", ["line 2", "not a JSON object"]),
    ("[1, 2]", ["line 2", "list"]),
    ('{"timestamp": 1, "input_length": 10, "hash_ids": [3]}', ["line 2", "output_length",
                                                              "missing"]),
    ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [3]}',
     ["line 2", "timestamp", "-1"]),
    ('{"timestamp": 1, "input_length": "10", "output_length": 1, "hash_ids": [3]}',
     ["line 2", "input_length", "'10'"]),
    ('{"timestamp": 1, "input_length": 10, "output_length": true, "hash_ids": [3]}',
     ["line 2", "output_length", "True"]),
    ('{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [3.5]}',
     ["line 2", "hash_ids", "3.5"]),
    ('{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": 3}',
     ["line 2", "hash_ids", "list"]),
    ('{"timestamp": 1, "input_length": 1100, "output_length": 1, "hash_ids": [3, 4]}',
     ["line 2", "hash_ids", "has 2 ids", "1100", "3 blocks"]),
    ('{"timestamp": 1, "input_length": 900, "output_length": 1, "hash_ids": [3, 3]}',
     ["line 2", "hash_ids", "block 3 twice"]),
])
def test_a_bad_line_is_named_with_its_field(tmp_path, line, names):
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD + "\n" + line + "\n")
    with pytest.raises(TraceError) as caught:
        read_trace(str(path))
    for name in names:
        assert name in str(caught.value)
    assert str(path) in str(caught.value)


def test_reader_keeps_order_takes_the_first_n_and_refuses_time_going_back(tmp_path):
    path = tmp_path / "t.jsonl"
    later = GOOD.replace('"timestamp": 0', '"timestamp": 7').replace("[0, 1]", "[0, 2]")
    path.write_text(GOOD + "\n\n" + later + "\n" + GOOD + "\n")
    first = read_trace(str(path), limit=2)
    assert [r.hash_ids for r in first] == [(0, 1), (0, 2)]
    assert [r.line for r in first] == [1, 3]  # the blank line is skipped, lines counted
    assert first[0].block_tokens() == [512, 88]
    assert footprint_blocks(first) == 3
    with pytest.raises(TraceError, match=r"line 4: field 'timestamp' is 0, earlier than 7 "
                                         r"on line 3"):
        read_trace(str(path))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(str(empty))
    with pytest.raises(TraceError, match="--requests 0"):
        read_trace(str(path), limit=0)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(GOOD.encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceError, match="line 2: not UTF-8 text"):
        read_trace(str(binary))


@pytest.mark.parametrize("budget, says", [
    ("0", "above 0 and at most 1"), ("1.5", "above 0 and at most 1"),
    ("ten", "'ten' is not a number"),
])
def test_cli_refuses_a_bad_fraction(tmp_path, capsys, budget, says):
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD + "\n")
    with pytest.raises(SystemExit) as stop:
        bench_main(["--trace", str(path), "--budget", budget])
    assert stop.value.code == 2
    assert says in capsys.readouterr().err


def test_cli_names_the_bad_line_and_needs_a_budget(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD + "\n" + GOOD.replace("[0, 1]", "[0]") + "\n")
    assert bench_main(["--trace", str(path), "--budget", "0.5", "--root",
                       str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "line 2: field 'hash_ids' has 1 ids" in err
    assert bench_main(["--trace", str(path), "--root", str(tmp_path)]) == 2
    assert "--trace needs --budget" in capsys.readouterr().err
    assert bench_main(["--trace", str(tmp_path / "none.jsonl"), "--budget", "0.5"]) == 2
    assert "cannot read the trace" in capsys.readouterr().err
    assert bench_main(["--budget", "0.5"]) == 2
    assert "go with --trace" in capsys.readouterr().err


# -- replays through a real tier ------------------------------------------------------------

def _write_trace(path, streams: list[list[int]]) -> None:
    with open(path, "w") as f:
        for n, ids in enumerate(streams):
            f.write(json.dumps({"timestamp": 10 * n, "input_length": 512 * len(ids) - 7,
                                "output_length": 3, "hash_ids": ids}) + "\n")


def test_block_content_differs_for_every_id_in_every_word():
    content = BlockContent(4 * KB)
    a, b = content.of([5, 6]).view("u8")
    assert (a != b).all()
    assert (content.of([5]) == content.of([5])).all()


def _check_counts(c: dict, block_bytes: int) -> None:
    assert c["wrong_bytes"] == 0
    assert c["lookups"] == c["lookup_hits"] + c["lookup_misses"]
    assert c["lookup_hits"] == c["blocks_hit"] + c["blocks_lost_on_load"]
    missed = c["blocks_requested"] - c["blocks_hit"]
    assert c["blocks_stored"] + c["blocks_store_failed"] == missed
    assert c["bytes_served"] == c["blocks_hit"] * block_bytes
    assert c["bytes_written"] == c["bytes_stored"] == c["blocks_stored"] * block_bytes
    assert c["enospc_jobs"] <= c["failed_jobs"]["store"]


@pytest.mark.slow
def test_replay_through_a_real_tier_verifies_every_byte(tmp_path, backend):
    streams = _prefix_trace(40, seed=3)
    path = tmp_path / "t.jsonl"
    _write_trace(path, streams)
    requests = read_trace(str(path))
    block = 16 * KB
    footprint = footprint_blocks(requests)
    budget = footprint * block // 3
    folder = tmp_path / "kv"
    c = Replay(requests, block, str(folder), budget,
               {"native": backend == "native", **SMALL_POOL}).run()
    _check_counts(c, block)
    assert c["tier"]["backend"] == backend
    assert c["blocks_requested"] == sum(len(s) for s in streams)
    assert c["blocks_hit"] > 0, "a prefix trace with shared blocks must hit"
    assert c["blocks_hit"] <= simulate_unbounded(streams).blocks_hit
    assert c["evicted_blocks"] > 0, "a third of the footprint must evict"
    # Answers are read in order up to the first miss: at most one miss per request, and
    # the first request (an empty tier) has one.
    assert 1 <= c["lookup_misses"] <= len(streams)
    assert c["usage"]["final_walked_bytes"] > 0 and c["usage"]["walks"] >= 1
    assert c["usage"]["peak_walked_bytes"] >= c["usage"]["final_walked_bytes"]


@pytest.mark.slow
def test_cli_replay_prints_the_comparison_and_writes_json(tmp_path, capsys):
    streams = _prefix_trace(30, seed=5)
    path = tmp_path / "t.jsonl"
    _write_trace(path, streams)
    out = tmp_path / "r.json"
    assert bench_main(["--trace", str(path), "--budget", "0.4", "--requests", "25",
                       "--block-bytes", "8K", "--root", str(tmp_path), "--json", str(out),
                       "--no-progress"]) == 0
    text = capsys.readouterr().out
    for label in ("tier", "LRU (sim)", "Belady (sim)", "usage / budget", "wrong bytes: 0",
                  "bytes written per byte served", "store room waits"):
        assert label in text
    doc = json.loads(out.read_text())
    assert doc["kind"] == "trace" and doc["trace"]["requests"] == 25
    first = streams[:25]
    footprint = len({b for ids in first for b in ids})
    assert doc["trace"]["footprint_blocks"] == footprint
    assert doc["budget"]["bytes"] == int(0.4 * footprint * 8 * KB)
    assert doc["budget"]["blocks"] == doc["budget"]["bytes"] // (8 * KB)
    sims = doc["simulated"]
    assert sims["lru"]["blocks_hit"] == simulate_lru(first, doc["budget"]["blocks"]).blocks_hit
    assert sims["lru"]["hit_ratio"] <= sims["belady"]["hit_ratio"] <= \
        sims["unbounded"]["hit_ratio"]
    assert sims["lru"]["blocks_requested"] == doc["tier"]["blocks_requested"]
    _check_counts(doc["tier"], 8 * KB)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("mptier-trace-")] == []


class _CorruptAfterFirst(Replay):
    """Overwrites the start of every block file the first request stored."""

    def _request(self, tier, buf, n, request):
        super()._request(tier, buf, n, request)
        if n == 0:
            for block in request.hash_ids:
                with open(tier.path_for(self._key(block)), "r+b") as f:
                    f.write(b"\0" * 100)


def test_a_wrong_byte_on_disk_is_counted(tmp_path, backend):
    path = tmp_path / "t.jsonl"
    _write_trace(path, [[1, 2], [1, 2, 3]])
    block = 16 * KB
    c = _CorruptAfterFirst(read_trace(str(path)), block, str(tmp_path / "kv"), 64 * block,
                           {"native": backend == "native", "checksum_blocks": False,
                            **SMALL_POOL}).run()
    assert c["blocks_hit"] == 2
    # The content's words are random: a zero byte where one was expected is rare, so
    # nearly all of the 100 zeroed bytes of each block differ.
    assert 150 < c["wrong_bytes"] <= 200
