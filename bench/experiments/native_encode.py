"""Prototype: a job's task records encoded in C (cffi) against mptier.jobs.encode_job.

    python bench/experiments/native_encode.py [--n 20000]

Builds a small cffi extension in a temporary folder (needs a C compiler), checks that
its records are byte-for-byte those of encode_job for 16-block jobs (4 and 16 blocks
per task), then times both per call in thread CPU time, and the whole engine-side
submit path pieces (array of ids, join of keys) around it.
"""

from __future__ import annotations

import argparse
import array
import atexit
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time

import cffi

from mptier.jobs import TASK_RECORD_BYTES, WIRE_VERSION, TaskKind, encode_job
from mptier.keys import make_key

CDEF = """
int mpt_encode_job(unsigned char *out, size_t out_len, int kind, uint64_t first_task,
                   const unsigned char *keys, size_t key_len, size_t n,
                   const int64_t *ids, size_t per_task);
"""

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#define RECORD 4096
#define HEADER 20
/* One fixed-size little-endian record per per_task keys of equal length key_len:
 * "MPT" version kind attempt=0 reserved=0 n(u32) task_id(u64), ids (u64, not for
 * EXISTS=3), lengths (u16), keys. out is zeroed by the caller. */
int mpt_encode_job(unsigned char *out, size_t out_len, int kind, uint64_t first_task,
                   const unsigned char *keys, size_t key_len, size_t n,
                   const int64_t *ids, size_t per_task)
{
    size_t n_tasks = (n + per_task - 1) / per_task;
    if (n_tasks * RECORD > out_len)
        return -1;
    for (size_t t = 0; t < n_tasks; t++) {
        unsigned char *r = out + t * RECORD, *p;
        size_t start = t * per_task, m = n - start < per_task ? n - start : per_task;
        uint32_t m32 = (uint32_t)m;
        uint64_t task_id = first_task + t;
        if (HEADER + m * ((kind == 3 ? 0 : 8) + 2 + key_len) > RECORD)
            return -2;
        r[0] = 'M'; r[1] = 'P'; r[2] = 'T'; r[3] = VERSION; r[4] = (unsigned char)kind;
        memcpy(r + 8, &m32, 4);
        memcpy(r + 12, &task_id, 8);
        p = r + HEADER;
        if (kind != 3) {
            memcpy(p, ids + start, 8 * m);
            p += 8 * m;
        }
        for (size_t i = 0; i < m; i++, p += 2) {
            uint16_t len = (uint16_t)key_len;
            memcpy(p, &len, 2);
        }
        memcpy(p, keys + start * key_len, m * key_len);
    }
    return (int)n_tasks;
}
"""


def build() -> object:
    folder = tempfile.mkdtemp(prefix="mptier-encode-")
    atexit.register(shutil.rmtree, folder, True)
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source("_mpt_encode_proto", SOURCE.replace("VERSION", str(WIRE_VERSION)),
                   extra_compile_args=["-O2"])
    library = ffi.compile(tmpdir=folder, verbose=False)
    # Loaded from its file: no folder is added to the import path.
    spec = importlib.util.spec_from_file_location("_mpt_encode_proto", library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=20000)
    args = p.parse_args()
    mod = build()
    ffi, lib = mod.ffi, mod.lib

    def native_encode(kind, first, keys, ids, per_task):
        n = len(keys)
        out = bytearray(-(-n // per_task) * TASK_RECORD_BYTES)
        blob = b"".join(keys)
        rc = lib.mpt_encode_job(ffi.from_buffer(out), len(out), int(kind), first, blob,
                                len(keys[0]), n, ffi.from_buffer("int64_t[]", ids), per_task)
        if rc < 0:
            raise ValueError("does not fit")
        return out

    keys = [make_key(os.urandom(32), 0) for _ in range(16)]
    ids = array.array("q", range(100, 116))
    for per_task in (4, 16):
        assert native_encode(TaskKind.STORE, 7, keys, ids, per_task) == \
            encode_job(TaskKind.STORE, 7, keys, ids, per_task)
    print(f"{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}; records identical")
    for per_task in (4, 16):
        res = {}
        for name, fn in (("encode_job (Python)", encode_job), ("C via cffi", native_encode)):
            samples = []
            for _ in range(5):
                c0 = time.thread_time_ns()
                for _ in range(args.n):
                    fn(TaskKind.STORE, 7, keys, ids, per_task)
                samples.append((time.thread_time_ns() - c0) / args.n)
            res[name] = statistics.median(samples)
        py, c = res["encode_job (Python)"], res["C via cffi"]
        print(f"16-block job, {per_task} blocks per task: encode_job {py / 1e3:.2f} µs, "
              f"C {c / 1e3:.2f} µs per call (x{py / c:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
