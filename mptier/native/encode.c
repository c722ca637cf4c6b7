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
 *
 * The worker's side, mpt_task_items: a record's items as the batch calls take them
 * (the paths of the file layout, the buffer offsets), without a Python object per key:
 * decoding the record and making a path per key in Python was ~40 us of a 16-block
 * task (bench/experiments/task_cpu.py). Its twin is mptier.native._pure_task.
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

static size_t mpt_u16_at(const unsigned char *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* Append the len bytes at p to the path being made at *out (room up to end). */
static int mpt_put(char **out, const char *end, const void *p, size_t len)
{
    if ((size_t)(end - *out) < len)
        return -ENOSPC;
    memcpy(*out, p, len);
    *out += len;
    return 0;
}

/* The layout's path of key (mptier.layout.FileMapper.relative_path_for): with h the hex
 * of the key less its last MPT_GROUP_IDX_BYTES bytes and g those bytes big-endian (a
 * shorter key: h empty, g its bytes), "<h[0:3]>/<h[3:5]>_g<g>/<h>.bin" and its NUL. */
static int mpt_key_path(char **out, const char *end, const unsigned char *key, size_t len)
{
    static const char hex[] = "0123456789abcdef";
    size_t hash_len = len > MPT_GROUP_IDX_BYTES ? len - MPT_GROUP_IDX_BYTES : 0;
    size_t hex_len = 2 * hash_len, n;
    uint32_t group = 0;
    char digits[10], *h;
    int k = 0;

    for (size_t i = hash_len; i < len; i++)
        group = group << 8 | key[i];
    do
        digits[k++] = (char)('0' + group % 10);
    while ((group /= 10) != 0);
    /* the bytes before "<h>.bin", where the hex is written once and the two folder
     * names copy their part of it from */
    n = (hex_len < 3 ? hex_len : 3) + 1 + (hex_len > 3 ? (hex_len < 5 ? hex_len : 5) - 3 : 0)
        + 2 + (size_t)k + 1;
    if ((size_t)(end - *out) < n + hex_len + 5)
        return -ENOSPC;
    h = *out + n;
    for (size_t i = 0; i < hash_len; i++) {
        h[2 * i] = hex[key[i] >> 4];
        h[2 * i + 1] = hex[key[i] & 15];
    }
    memmove(*out, h, hex_len < 3 ? hex_len : 3);
    *out += hex_len < 3 ? hex_len : 3;
    *(*out)++ = '/';
    if (hex_len > 3) {
        size_t m = (hex_len < 5 ? hex_len : 5) - 3;
        memmove(*out, h + 3, m);
        *out += m;
    }
    *(*out)++ = '_';
    *(*out)++ = 'g';
    while (k > 0)
        *(*out)++ = digits[--k];
    *(*out)++ = '/';
    *out += hex_len; /* the hex is already there */
    return mpt_put(out, end, ".bin", 5);
}

/* Decode record (record_len bytes) into the paths of its keys (NUL-terminated, back to
 * back, in paths: paths_len bytes; *paths_used set to the bytes written) and, unless it
 * is a lookup record, the buffer offsets of its blocks (offsets[i] = block id i *
 * block_bytes, or UINT64_MAX where that overflows: outside any buffer; max_items of
 * them at most). Returns the
 * number of items; -EINVAL for a record mptier.jobs.decode_task refuses (magic, version,
 * kind, items or keys past its end); -ENOSPC when paths or max_items are too small (see
 * MPT_TASK_PATHS_BYTES, MPT_TASK_MAX_ITEMS). */
int mpt_task_items(const unsigned char *record, size_t record_len, size_t block_bytes,
                   char *paths, size_t paths_len, size_t *paths_used, uint64_t *offsets,
                   size_t max_items)
{
    const unsigned char *ids, *lengths, *key;
    const char *end = paths + paths_len;
    char *out = paths;
    size_t id_bytes, key_bytes = 0;
    uint32_t n;
    int kind;

    *paths_used = 0;
    if (record_len < MPT_TASK_HEADER_BYTES || memcmp(record, "MPT", 3) != 0 ||
        record[3] != MPT_WIRE_VERSION)
        return -EINVAL;
    kind = record[4];
    if (kind != MPT_KIND_STORE && kind != MPT_KIND_LOAD && kind != MPT_KIND_LOOKUP)
        return -EINVAL;
    n = (uint32_t)record[8] | (uint32_t)record[9] << 8 | (uint32_t)record[10] << 16 |
        (uint32_t)record[11] << 24; /* the header is little-endian (struct "<") */
    id_bytes = kind == MPT_KIND_LOOKUP ? 0 : 8;
    if (record_len > MPT_TASK_RECORD_BYTES)
        record_len = MPT_TASK_RECORD_BYTES;
    if (n > (record_len - MPT_TASK_HEADER_BYTES) / (id_bytes + 2))
        return -EINVAL;
    ids = record + MPT_TASK_HEADER_BYTES;
    lengths = ids + id_bytes * n;
    key = lengths + 2 * (size_t)n;
    /* Block ids and key lengths lie in the machine's order, as the encoders (this file's
     * memcpy, mptier.jobs' arrays) write them and decode_task reads them. */
    for (uint32_t i = 0; i < n; i++)
        key_bytes += mpt_u16_at(lengths + 2 * (size_t)i);
    if (key_bytes > (size_t)(record + record_len - key))
        return -EINVAL;
    if (id_bytes && n > max_items)
        return -ENOSPC;
    for (uint32_t i = 0; i < n; i++) {
        size_t len = mpt_u16_at(lengths + 2 * (size_t)i);
        int rc = mpt_key_path(&out, end, key, len);

        if (rc)
            return rc;
        key += len;
        if (id_bytes) {
            uint64_t id, offset;
            memcpy(&id, ids + 8 * (size_t)i, 8);
            offsets[i] = __builtin_mul_overflow(id, (uint64_t)block_bytes, &offset)
                         ? UINT64_MAX : offset;
        }
    }
    *paths_used = (size_t)(out - paths);
    return (int)n;
}
