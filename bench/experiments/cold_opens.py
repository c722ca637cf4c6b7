"""Where a lone job's time goes when its files' folders and inodes are not in memory
(the bench's "64-block job alone" drops the page cache, dentries and inodes included,
between its store and its load): 64 cold opens on 1, 4, 16, 64 threads (cold_opens.c);
the same opens each followed by its block's O_DIRECT read on 1, 4, 16, 64 threads (the
fastest this machine does a lone job's opens and reads together; at one thread, the way
vLLM + C runs a job); the same opens as a lookup in the ring (O_PATH,
``Backend.batch_lookup``); the tier's 64-block load with the whole cache dropped
(``drop_caches`` 3) and with only the page cache dropped (1: folders and inodes stay);
with ``--tier`` tiers of other settings; and with ``--vllm`` (run from the environment
scripts/vllm-env.sh makes) vLLM + C's load of its own 64 blocks, its tier driven as the
bench drives it. Every way gets its own fresh blocks each round, stored beside
``--background`` others (a root in use), and the ways run in a shuffled order each
round. Needs root (drop_caches) and gcc.

    sudo python bench/experiments/cold_opens.py --root /var/tmp --rounds 5
    sudo .venv-vllm/bin/python bench/experiments/cold_opens.py --root /var/tmp --vllm

docs/performance.md, sections 24 and 25.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import select
import shutil
import statistics
import subprocess
import tempfile
import time

from mptier import FileSystemTier, SharedKVBuffer, TransferJob, make_key, native
from mptier.config import parse_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
POLL_S = 0.0005  # how often vLLM's finished jobs are asked for: the bench's light scheduler


def drop(level: int) -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write(str(level))
    time.sleep(0.05)  # let the drop's own writes settle


def keys_for(tag: str, n: int) -> list[bytes]:
    return [make_key(hashlib.sha256(f"{tag}-{i}".encode()).digest(), 0) for i in range(n)]


def store(tier: FileSystemTier, keys: list[bytes], n: int) -> None:
    for start in range(0, len(keys), n):
        part = keys[start:start + n]
        tier.submit_store(TransferJob(start, part, list(range(len(part)))))
        tier.drain_jobs()
        assert all(r.success for r in tier.get_finished_jobs())


def timed_load(tier: FileSystemTier, keys: list[bytes], n: int) -> float:
    start = time.perf_counter()
    tier.submit_load(TransferJob(1, keys, list(range(n, 2 * n))))
    done = []
    while not done:
        select.select([tier.fileno()], [], [], 1.0)
        done = tier.get_finished_jobs()
    assert done[0].success, done[0].error
    return (time.perf_counter() - start) * 1e3


class VllmWay:
    """vLLM's file-system tier (C extension loaded) on a root of its own, through the
    bench's adapter, so its jobs run exactly as in the bench's ``vllm`` design."""

    def __init__(self, buf: SharedKVBuffer, root: str, block_bytes: int) -> None:
        from mptier.bench.base import MODEL_NAME, DesignContext
        from mptier.bench.designs import parse_spec
        from mptier.layout import FileMapper

        self.design = parse_spec("vllm").build()
        reason = self.design.available() or self.design.refusal()
        if reason is not None:
            raise SystemExit(f"--vllm: {reason}")
        self.design.setup(DesignContext(buf.view, buf, root, block_bytes,
                                        FileMapper(root, MODEL_NAME)))
        self.job_id = 1 << 20

    def _run(self, keys: list[bytes], slots: list[int], kind: str) -> float:
        self.job_id += 1
        job = self.design.make_job(self.job_id, keys, slots, kind)
        start = time.perf_counter()
        (self.design.submit_load if kind == "load" else self.design.submit_store)(job)
        done: list = []
        while not done:
            done = self.design.get_finished()
            if not done:
                time.sleep(POLL_S)
        assert all(r.success for r in done)
        return (time.perf_counter() - start) * 1e3

    def fill(self, keys: list[bytes], job_blocks: int, in_flight: int) -> float:
        """Store ``keys`` in jobs of ``job_blocks``, ``in_flight`` at once; the seconds."""
        start = time.perf_counter()
        sent = running = 0
        while sent < len(keys) or running:
            while running < in_flight and sent < len(keys):
                slot = self.job_id % in_flight * job_blocks
                part = keys[sent:sent + job_blocks]
                self.job_id += 1
                self.design.submit_store(self.design.make_job(
                    self.job_id, part, list(range(slot, slot + len(part))), "store"))
                sent += len(part)
                running += 1
            done = self.design.get_finished()
            assert all(r.success for r in done)
            running -= len(done)
            if not done:
                time.sleep(POLL_S)
        return time.perf_counter() - start

    def store(self, keys: list[bytes], n: int) -> None:
        for start in range(0, len(keys), n):
            part = keys[start:start + n]
            self._run(part, list(range(len(part))), "store")

    def timed_load(self, keys: list[bytes], n: int) -> float:
        return self._run(keys, list(range(n, 2 * n)), "load")

    def close(self) -> None:
        self.design.close()  # notes which I/O path ran: C, or vLLM's Python fallback
        for note in self.design.notes:
            print(f"vllm: {note}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="/var/tmp")
    ap.add_argument("--block", default="256K")
    ap.add_argument("--blocks", type=int, default=64, help="blocks of the lone job")
    ap.add_argument("--background", type=int, default=2048,
                    help="blocks stored first, so the root's folders are a tier's in use")
    ap.add_argument("--threads", default="1,4,16,64", help="threads that only open")
    ap.add_argument("--read-threads", default="1,4,16,64",
                    help="threads that open and read each block ('' for none)")
    ap.add_argument("--kept-read-threads", default="16",
                    help="the same with folders and inodes kept ('' for none)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tier", action="append", default=[], metavar="KEY=VALUE,...",
                    help="also the cold load of a tier with these settings, each on a "
                         "root of its own (repeatable), e.g. bounce_waves=false")
    ap.add_argument("--vllm", action="store_true",
                    help="also vLLM + C's load of a lone job (needs vLLM with fs_io_C)")
    a = ap.parse_args()
    block_bytes, n = parse_bytes(a.block), a.blocks
    work = tempfile.mkdtemp(prefix="cold-opens-")
    helper = os.path.join(work, "cold_opens")
    subprocess.run(["gcc", "-O2", "-pthread", "-o", helper,
                    os.path.join(HERE, "cold_opens.c")], check=True)
    buf = SharedKVBuffer.create(2 * n, block_bytes)
    buf.view[:] = 3
    root = tempfile.mkdtemp(dir=a.root, prefix="cold-opens-")
    tier = FileSystemTier(buf, root_dir=root)
    ways = [f"threads={t}" for t in a.threads.split(",") if t] + [
        f"open+read threads={t}" for t in a.read_threads.split(",") if t] + [
        f"open+read, folders and inodes kept, threads={t}"
        for t in a.kept_read_threads.split(",") if t] + [
        "ring lookup", "tier load, cache dropped", "tier load, folders and inodes kept"]
    variants: dict[str, tuple[FileSystemTier, str]] = {}
    for text in a.tier:
        settings = dict(part.split("=", 1) for part in text.split(",") if part)
        settings = {k: {"true": True, "false": False}.get(v, v) for k, v in settings.items()}
        variant_root = tempfile.mkdtemp(dir=a.root, prefix="cold-opens-variant-")
        variant = FileSystemTier(buf, root_dir=variant_root, **settings)
        variants[f"tier[{text}] load, cache dropped"] = (variant, variant_root)
        variants[f"tier[{text}] load, folders and inodes kept"] = (variant, "")
    ways += list(variants)
    vllm_root = vllm = None
    if a.vllm:
        vllm_root = tempfile.mkdtemp(dir=a.root, prefix="cold-opens-vllm-")
        vllm = VllmWay(buf, vllm_root, block_bytes)
        ways.append("vllm + C load, cache dropped")
    times: dict[str, list[float]] = {way: [] for way in ways}
    try:
        store(tier, keys_for("background", a.background), n)
        if vllm is not None:
            vllm.store(keys_for("background", a.background), n)
        for variant, variant_root in variants.values():
            if variant_root:
                store(variant, keys_for("background", a.background), n)
        shuffle = random.Random(1)
        blocks_dir = tier.mapper.blocks_dir
        for rnd in range(a.rounds):
            shuffle.shuffle(ways)
            for way in ways:
                keys = keys_for(f"{rnd}-{way}", n)
                if way.startswith("vllm"):
                    vllm.store(keys, n)
                    drop(3)
                    times[way].append(vllm.timed_load(keys, n))
                    continue
                if way in variants:
                    variant = variants[way][0]
                    store(variant, keys, n)
                    drop(1 if "kept" in way else 3)
                    times[way].append(timed_load(variant, keys, n))
                    continue
                store(tier, keys, n)
                paths = [tier.mapper.relative_path_for(k) for k in keys]
                drop(1 if "kept" in way else 3)
                if "threads=" in way:
                    reads = [str(block_bytes)] if way.startswith("open+read") else []
                    out = subprocess.run(
                        [helper, way.rsplit("=", 1)[1], *reads], check=True, capture_output=True,
                        text=True, input="\n".join(f"{blocks_dir}/{p}" for p in paths))
                    times[way].append(float(out.stdout))
                elif way == "ring lookup":
                    start = time.perf_counter()
                    found = native.batch_lookup(blocks_dir, paths, block_bytes, uring=True)
                    times[way].append((time.perf_counter() - start) * 1e3)
                    assert set(found) == {native.LOOKUP_PRESENT}, found
                else:
                    times[way].append(timed_load(tier, keys, n))
            print(f"round {rnd + 1} of {a.rounds} done", flush=True)
    finally:
        tier.shutdown()
        if vllm is not None:
            vllm.close()
            shutil.rmtree(vllm_root)
        for variant, variant_root in variants.values():
            if variant_root:
                variant.shutdown()
                shutil.rmtree(variant_root)
        shutil.rmtree(root)
        shutil.rmtree(work)
        buf.close()
        buf.unlink()
    print(f"{n} blocks of {a.block} on {a.root}, beside {a.background} others; ms, "
          f"median and every round:")
    for way in sorted(times):
        got = times[way]
        print(f"  {way:36s} {statistics.median(got):7.2f}   "
              + " ".join(f"{x:.1f}" for x in got))


if __name__ == "__main__":
    main()
