/*
 * encode.c - the engine's task records, built in one call.
 *
 * mptier.jobs.encode_job cuts a job into fixed-size records (the layout is in
 * mptier/jobs.py's docstring; all little-endian):
 *
 *   "MPT" version(u8) kind(u8) attempt(u8)=0 reserved(u16)=0 n(u32) task_id(u64)
 *   n x block id (u64, not for lookups), n x key length (u16), the keys, zero padding
 *
 * This is the same, for the common case of keys of one length, on the engine's
 * scheduler thread: a Python struct packing per record costs several microseconds a
 * job (bench/experiments/native_encode.py); this costs one call. The Python encoder
 * stays as the twin and for keys of mixed lengths; tests/test_jobs.py checks that both
 * give the same bytes.
 */

#include "mptier_native.h"

#include <string.h>

/* Write the records of n keys of key_len bytes (back to back in keys) with block ids
 * ids[0..n) (ignored for lookups), per_task items per record, task ids first_task
 * onwards, into out (out_len bytes, zeroed by the caller). Returns the number of
 * records, -ENOSPC when out is too small, -E2BIG when per_task items do not fit a
 * record, -EINVAL for per_task 0, -EOPNOTSUPP on a big-endian machine. Nothing is written on an error. */
int mpt_encode_job(unsigned char *out, size_t out_len, int kind, uint64_t first_task,
                   const unsigned char *keys, size_t key_len, size_t n, const int64_t *ids,
                   size_t per_task)
{
    size_t n_tasks, id_bytes = kind == MPT_KIND_LOOKUP ? 0 : 8;
    uint16_t len16 = (uint16_t)key_len;

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
    return -EOPNOTSUPP; /* the fields are copied as they lie in memory: the twin encodes */
#endif
    if (per_task == 0 || key_len > UINT16_MAX)
        return -EINVAL;
    n_tasks = (n + per_task - 1) / per_task;
    if (n_tasks > out_len / MPT_TASK_RECORD_BYTES)
        return -ENOSPC;
    if (n > 0 && MPT_TASK_HEADER_BYTES + (n < per_task ? n : per_task) *
                                             (id_bytes + 2 + key_len) > MPT_TASK_RECORD_BYTES)
        return -E2BIG;
    for (size_t t = 0; t < n_tasks; t++) {
        unsigned char *r = out + t * MPT_TASK_RECORD_BYTES, *p;
        size_t start = t * per_task, m = n - start < per_task ? n - start : per_task;
        uint32_t m32 = (uint32_t)m;
        uint64_t task_id = first_task + t;

        r[0] = 'M';
        r[1] = 'P';
        r[2] = 'T';
        r[3] = MPT_WIRE_VERSION;
        r[4] = (unsigned char)kind; /* attempt and reserved stay zero */
        memcpy(r + 8, &m32, 4); /* little-endian, as in memory (checked above) */
        memcpy(r + 12, &task_id, 8);
        p = r + MPT_TASK_HEADER_BYTES;
        if (id_bytes) {
            memcpy(p, ids + start, 8 * m);
            p += 8 * m;
        }
        for (size_t i = 0; i < m; i++, p += 2)
            memcpy(p, &len16, 2);
        memcpy(p, keys + start * key_len, m * key_len);
    }
    return (int)n_tasks;
}
