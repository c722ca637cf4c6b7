/*
 * mptier_io.c - batch block I/O for mptier, in plain C.
 *
 * One call stores, loads or looks up a whole batch of fixed-size blocks beneath a root
 * directory. The caller (cffi, with the GIL released) hands over raw pointers only:
 *
 *   root         a descriptor of the root directory (mptier.native.open_root)
 *   paths_blob   n NUL-terminated paths relative to root, back to back ("a\0b\0c\0")
 *   base         start of the caller's buffer; block i lives at base + offsets[i]
 *   base_len     the buffer's length: a block not wholly inside it fails with EINVAL
 *                before any I/O of it (the caller's own mapping's size, see mpt_inside)
 *   block_bytes  size of every block
 *
 * Every function returns 0 or -errno and never touches a Python object. A batch stops
 * at its first failing block: *n_done blocks (0 .. *fail_index - 1) completed, block
 * *fail_index failed with the returned errno, and nothing after it is published,
 * removed or touched. The memory of a load's blocks from *fail_index on is undefined:
 * the failing block may be partly read, and with MPT_URING (uring.c) later blocks may
 * have been read meanwhile -- never reported as loaded. Every transfer into the
 * caller's memory has ended when a call returns.
 *
 * With MPT_URING, store and load run through io_uring, several blocks in flight
 * (uring.c); every decision stays the loop's, in batch order, and the loop below runs
 * wherever io_uring cannot.
 *
 * Nothing under the root is reached through a symlink. Paths resolve with openat2
 * (RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) where the kernel has it, else (or with
 * MPT_NO_OPENAT2) one component at a time with O_NOFOLLOW. A symlink met at the leaf or
 * at a sub-folder is removed; only a regular file of exactly block_bytes is served:
 *
 *   entry at the path      load                 store                   lookup
 *   regular, exact size    read (CRC checked)   done (touched)          PRESENT
 *   missing                ENOENT               written                 ABSENT
 *   symlink (leaf/folder)  removed, ELOOP       removed, written        removed, SYMLINK
 *   shorter (or empty)     removed, ENODATA     removed, written        SHORT (left)
 *   longer                 EFBIG (left)         EFBIG (left)            BAD
 *   dir, FIFO, device...   EMEDIUMTYPE (left)   EMEDIUMTYPE (left)      BAD
 *   file at a sub-folder   ENOTDIR (left)       ENOTDIR (left)          BAD
 *   record mismatch        removed, EBADMSG     -                       -
 *
 * "Removed" is done only while the name still points at the inode that was examined.
 *
 * Store publishes each block without a partial file ever showing at its final name:
 * with MPT_TMPFILE into an unnamed O_TMPFILE file that is linked into place, otherwise
 * (or where O_TMPFILE is refused) into "<final>.<tag>.<counter>.tmp" (O_EXCL), renamed
 * onto the final name. <tag> names the writer's lease, so a sweeper can tell a dead
 * writer's leftovers. With MPT_CHECKSUM the CRC32C record (vLLM's xattr) is set on the
 * temporary file's descriptor before it is published.
 *
 * This file holds the batch calls and the loop; one block's system calls are block.c's
 * (mpt_load_one, mpt_store_one). The native core is the files build_ffi.py lists in
 * C_FILES, compiled together; mptier_native.h is what they share and names their floors
 * (a file calls only into the floors below it). _pure.py is the Python twin of them all
 * and must keep the same behaviour, step for step.
 */

#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* O_PATH */
#endif

#include "mptier_native.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/vfs.h>
#include <unistd.h>

/* -- batches ------------------------------------------------------------------------------ */

typedef int (*mpt_block_fn)(struct mpt_batch *b, const char *rel, char *p, size_t len,
                            int direct);

static int mpt_batch(int store, struct mpt_batch *b, const char *paths_blob, size_t n,
                     char *base, const uint64_t *offsets, size_t block_bytes,
                     size_t *n_done, size_t *fail_index)
{
    mpt_block_fn one = store ? mpt_store_one : mpt_load_one;
    const char *path = paths_blob;
    size_t i;

    *n_done = 0;
    *fail_index = n;
    for (i = 0; i < n; i++) {
        char *p = base + offsets[i];
        char *io = b->bounce != NULL ? b->bounce : p; /* bounced: the I/O's memory */
        int direct = mpt_direct_ok(b->flags, io, block_bytes);
        int rc;
        b->found_one = 0;
        if (store && io != p)
            memcpy(io, p, block_bytes); /* a bounced store writes from its own pages */
        rc = one(b, path, io, block_bytes, direct);
        if (rc == -EINVAL && direct)
            rc = one(b, path, io, block_bytes, 0); /* never fail a block over O_DIRECT */
        if (rc != 0) {
            *fail_index = i;
            return rc;
        }
        if (b->found != NULL)
            b->found[i] = (uint8_t)b->found_one;
        if (!store && io != p) {
            mpt_map_slot(p, block_bytes);
            mpt_copy_to_slot(p, io, block_bytes); /* only after the read returned */
        }
        *n_done = i + 1;
        path += strlen(path) + 1;
    }
    return 0;
}

/* Whether checksummed O_DIRECT I/O under root should take the chunked path. */
static int mpt_memory_fs(int root, int flags)
{
    struct statfs sf;
    if ((flags & (MPT_CHECKSUM | MPT_O_DIRECT)) != (MPT_CHECKSUM | MPT_O_DIRECT) ||
        fstatfs(root, &sf) != 0)
        return 0;
    return (unsigned long)sf.f_type == MPT_TMPFS_MAGIC ||
           (unsigned long)sf.f_type == MPT_RAMFS_MAGIC;
}

/* How many blocks, from the first, lie wholly inside the caller's buffer of base_len
 * bytes (block i is [offsets[i], offsets[i] + block_bytes)). The buffer's length is the
 * caller's own mapping, never a number from a task record: in a service the task records
 * come from an engine that is not trusted, so a block id past the buffer must not turn
 * into a read or write of the worker's other memory. One compare per block. */
static size_t mpt_inside(const uint64_t *offsets, size_t n, size_t block_bytes,
                         size_t base_len)
{
    uint64_t last; /* the last offset a whole block fits at */
    size_t i;

    if (block_bytes > base_len)
        return 0;
    last = base_len - block_bytes;
    for (i = 0; i < n && offsets[i] <= last; i++)
        ;
    return i;
}

/* Run a store (store != 0) or load over the blocks inside the buffer; a block outside it
 * fails with EINVAL, as if its I/O had: the blocks before it are done, it and those after
 * it are not touched (no file written, nothing at a final name). */
static int mpt_batch_inside(int store, struct mpt_batch *b, const char *paths_blob,
                            size_t n, char *base, size_t base_len, const uint64_t *offsets,
                            size_t block_bytes, size_t *n_done, size_t *fail_index)
{
    size_t inside = mpt_inside(offsets, n, block_bytes, base_len);
    int rc = MPT_NO_URING;

    *n_done = 0;
    *fail_index = 0;
    if (inside == 0)
        return n == 0 ? 0 : -EINVAL;
    if (b->flags & MPT_URING)
        rc = mpt_uring_batch(store, b, paths_blob, inside, base, offsets, block_bytes,
                             n_done, fail_index);
    if (rc == MPT_NO_URING)
        rc = mpt_batch(store, b, paths_blob, inside, base, offsets, block_bytes, n_done,
                       fail_index);
    if (rc == 0 && inside < n) {
        *n_done = inside;
        *fail_index = inside;
        rc = -EINVAL;
    }
    return rc;
}

static int mpt_store_batch(int root, const char *paths_blob, size_t n, char *base,
                           size_t base_len, const uint64_t *offsets, size_t block_bytes,
                           int flags, const char *tag, char *bounce, size_t bounce_blocks,
                           size_t *n_done, size_t *fail_index, int *tmp_unlink_errno,
                           uint8_t *found)
{
    struct mpt_batch b = {root, flags, tag, 0, mpt_memory_fs(root, flags), bounce,
                          bounce_blocks};
    int rc;

    b.found = found;
    if (found != NULL)
        memset(found, 0, n);
    rc = mpt_batch_inside(1, &b, paths_blob, n, base, base_len, offsets, block_bytes,
                          n_done, fail_index);

    *tmp_unlink_errno = b.tmp_errno;
    return rc;
}

int mpt_batch_store(int root, const char *paths_blob, size_t n, char *base, size_t base_len,
                    const uint64_t *offsets, size_t block_bytes, int flags, const char *tag,
                    size_t *n_done, size_t *fail_index, int *tmp_unlink_errno,
                    uint8_t *found)
{
    return mpt_store_batch(root, paths_blob, n, base, base_len, offsets, block_bytes, flags,
                           tag, NULL, 0, n_done, fail_index, tmp_unlink_errno, found);
}

int mpt_batch_store_via(int root, const char *paths_blob, size_t n, char *base,
                        size_t base_len, const uint64_t *offsets, size_t block_bytes,
                        int flags, const char *tag, char *bounce, size_t bounce_blocks,
                        size_t *n_done, size_t *fail_index, int *tmp_unlink_errno,
                        uint8_t *found)
{
    if (bounce == NULL || bounce_blocks == 0) {
        *n_done = 0;
        *fail_index = 0;
        *tmp_unlink_errno = 0;
        return -EINVAL;
    }
    return mpt_store_batch(root, paths_blob, n, base, base_len, offsets, block_bytes, flags,
                           tag, bounce, bounce_blocks, n_done, fail_index, tmp_unlink_errno,
                           found);
}

int mpt_batch_load(int root, const char *paths_blob, size_t n, char *base, size_t base_len,
                   const uint64_t *offsets, size_t block_bytes, int flags, size_t *n_done,
                   size_t *fail_index)
{
    struct mpt_batch b = {root, flags, NULL, 0, mpt_memory_fs(root, flags)};

    return mpt_batch_inside(0, &b, paths_blob, n, base, base_len, offsets, block_bytes,
                            n_done, fail_index);
}

int mpt_batch_load_via(int root, const char *paths_blob, size_t n, char *base,
                       size_t base_len, const uint64_t *offsets, size_t block_bytes,
                       int flags, char *bounce, size_t bounce_blocks, size_t *n_done,
                       size_t *fail_index)
{
    struct mpt_batch b = {root, flags, NULL, 0, mpt_memory_fs(root, flags), bounce,
                          bounce_blocks};

    if (bounce == NULL || bounce_blocks == 0) {
        *n_done = 0;
        *fail_index = 0;
        return -EINVAL;
    }
    return mpt_batch_inside(0, &b, paths_blob, n, base, base_len, offsets, block_bytes,
                            n_done, fail_index);
}

int mpt_task_load(int root, const unsigned char *record, size_t record_len, char *base,
                  size_t base_len, size_t block_bytes, int flags, char *bounce,
                  size_t bounce_blocks, size_t *n_done, size_t *fail_index)
{
    char paths[MPT_TASK_PATHS_BYTES];
    uint64_t offsets[MPT_TASK_MAX_ITEMS];
    size_t used;
    int n = mpt_task_items(record, record_len, block_bytes, paths, sizeof paths, &used,
                           offsets, MPT_TASK_MAX_ITEMS);

    if (n < 0 || record[4] == MPT_KIND_LOOKUP) {
        *n_done = 0;
        *fail_index = 0;
        return -EINVAL;
    }
    if (bounce != NULL)
        return mpt_batch_load_via(root, paths, (size_t)n, base, base_len, offsets,
                                  block_bytes, flags, bounce, bounce_blocks, n_done,
                                  fail_index);
    return mpt_batch_load(root, paths, (size_t)n, base, base_len, offsets, block_bytes,
                          flags, n_done, fail_index);
}

int mpt_batch_lookup(int root, const char *paths_blob, size_t n, size_t block_bytes,
                     int flags, uint8_t *out)
{
    const char *path = paths_blob;
    /* with MPT_URING, the opens go to the device together: a cold lookup is a read or
     * two of metadata per key, one at a time here */
    if ((flags & MPT_URING) && !(flags & MPT_LOOP_LOOKUP) &&
        mpt_uring_lookup(root, paths_blob, n, block_bytes, flags, out) != MPT_NO_URING)
        return 0;
    for (size_t i = 0; i < n; i++) {
        out[i] = mpt_lookup_one(root, path, block_bytes, flags);
        path += strlen(path) + 1;
    }
    return 0;
}
