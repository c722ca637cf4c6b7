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
 * The native core is the files build_ffi.py lists in C_FILES, compiled together: this
 * one, resolve.c (paths beneath the root), crc32c.c, direct.c (checksummed O_DIRECT),
 * probes.c, uring.c (batches through io_uring) and encode.c (task records);
 * mptier_native.h is what they share. _pure.py is the Python twin of them all and must
 * keep the same behaviour, step for step.
 */

#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* O_DIRECT, O_TMPFILE, O_PATH, AT_EMPTY_PATH, UTIME_* */
#endif

#include "mptier_native.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/vfs.h>
#include <sys/xattr.h>
#include <unistd.h>

/* Buffered I/O with checksums moves a block in chunks of this size, checksumming each
 * chunk right after (load) or before (store) its copy, while it is still in the core's
 * cache: far below the 1 MiB L2 of current cores, far above a syscall's cost. */
#define MPT_CHUNK_BYTES (256 * 1024)
/* Status of a store attempt that could not use O_TMPFILE here: use a named file. */
#define MPT_USE_NAMED 1

static uint64_t mpt_counter;
static int mpt_empty_path_refused; /* linkat(AT_EMPTY_PATH) needs a capability we lack */

/* -- small helpers ------------------------------------------------------------------- */

uint64_t mpt_next_counter(void)
{
    return __atomic_fetch_add(&mpt_counter, 1, __ATOMIC_RELAXED);
}

int mpt_direct_ok(int flags, const char *p, size_t len)
{
    return O_DIRECT != 0 && (flags & MPT_O_DIRECT) &&
           (((uintptr_t)p | (uintptr_t)len) % MPT_DIRECT_ALIGN) == 0;
}

int mpt_write_all(int fd, const char *p, size_t len)
{
    while (len > 0) {
        ssize_t w = write(fd, p, len);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (w == 0)
            return -EIO;
        p += w;
        len -= (size_t)w;
    }
    return 0;
}

int mpt_pwrite_all(int fd, const char *p, size_t len, size_t offset)
{
    while (len > 0) {
        ssize_t w = pwrite(fd, p, len, (off_t)offset);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (w == 0)
            return -EIO;
        p += w;
        offset += (size_t)w;
        len -= (size_t)w;
    }
    return 0;
}

/* Bytes read (fewer than len only at end of file), or -errno. */
static ssize_t mpt_read_full(int fd, char *p, size_t len)
{
    size_t got = 0;
    while (got < len) {
        ssize_t r = read(fd, p + got, len - got);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (r == 0)
            break;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

void mpt_touch(int fd)
{
    /* atime only: the LRU clock of shared roots. Best effort (a reader that does not
     * own the file may not set it). */
    struct timespec ts[2] = {{0, UTIME_NOW}, {0, UTIME_OMIT}};
    (void)futimens(fd, ts);
}

void mpt_touch_at(int dirfd, const char *leaf)
{
    struct timespec ts[2] = {{0, UTIME_NOW}, {0, UTIME_OMIT}};
    (void)utimensat(dirfd, leaf, ts, AT_SYMLINK_NOFOLLOW);
}

void mpt_remove_if_same_fd(int root, const char *rel, int flags, int fd)
{
    struct stat held;
    if (fstat(fd, &held) == 0)
        mpt_remove_if_same(root, rel, flags, held.st_dev, held.st_ino);
}

/* -- the checksum record ---------------------------------------------------------------- */

/* Read fd's checksum record: 0 with *present = 1 and *want set, or 0 with *present = 0
 * (no record: the block loads unchecked); -EBADMSG: not 4 bytes; else -errno. */
int mpt_record_of(int fd, uint32_t *want, int *present)
{
    unsigned char val[8]; /* room for more than 4 bytes, to tell "too long" */
    ssize_t n = fgetxattr(fd, MPT_XATTR_NAME, val, sizeof val);

    *present = 0;
    if (n < 0) {
        if (errno == ENODATA || errno == ENOTSUP)
            return 0; /* written without checksums: valid, as vLLM reads it */
        return errno == ERANGE ? -EBADMSG : -errno;
    }
    if (n != 4)
        return -EBADMSG;
    *want = (uint32_t)val[0] << 24 | (uint32_t)val[1] << 16 | (uint32_t)val[2] << 8 | val[3];
    *present = 1;
    return 0;
}

int mpt_set_record(int fd, uint32_t crc)
{
    unsigned char val[4] = {(unsigned char)(crc >> 24), (unsigned char)(crc >> 16),
                            (unsigned char)(crc >> 8), (unsigned char)crc};
    return fsetxattr(fd, MPT_XATTR_NAME, val, sizeof val, 0) == 0 ? 0 : -errno;
}

/* -- load ------------------------------------------------------------------------------ */

/* Read len bytes; with check, CRC them. When the read is a CPU copy (buffered, or any
 * I/O on a memory file system) each chunk is checksummed right after it arrives, while
 * it is in cache; a device's direct read is checksummed chunk by chunk while the rest
 * is still in flight (direct.c), or whole after it where AIO is unavailable. */
static int mpt_read_block(int fd, char *dst, size_t len, int whole, int check, uint32_t *crc)
{
    size_t done = 0;
    ssize_t got;

    if (check && whole) {
        int rc = mpt_direct_read_crc(fd, dst, len, crc); /* CRC beside the transfer */
        if (rc != MPT_NO_AIO)
            return rc;
    }
    if (!check || whole) {
        got = mpt_read_full(fd, dst, len);
        if (got < 0)
            return (int)got;
        if ((size_t)got < len)
            return -ENODATA;
        if (check)
            *crc = mpt_crc32c(0, dst, len, MPT_CRC32C_BEST);
        return 0;
    }
    *crc = 0;
    while (done < len) {
        size_t part = len - done < MPT_CHUNK_BYTES ? len - done : MPT_CHUNK_BYTES;
        got = mpt_read_full(fd, dst + done, part);
        if (got < 0)
            return (int)got;
        *crc = mpt_crc32c(*crc, dst + done, (size_t)got, MPT_CRC32C_BEST);
        if ((size_t)got < part)
            return -ENODATA;
        done += part;
    }
    return 0;
}

int mpt_load_one(struct mpt_batch *b, const char *rel, char *dst, size_t len, int direct)
{
    struct stat st;
    uint32_t want = 0, got_crc = 0;
    int present = 0, rc, remove = 0;
    /* O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused after fstat) */
    int fd = mpt_open_beneath(b->root, rel,
                              O_RDONLY | O_NONBLOCK | O_NOCTTY | (direct ? O_DIRECT : 0),
                              b->flags);
    if (fd < 0)
        /* ENXIO, ENODEV: a socket or a device without a driver, never a block */
        return fd == -ENXIO || fd == -ENODEV ? -EMEDIUMTYPE : fd;
    if (fstat(fd, &st) != 0)
        rc = -errno;
    else if (!S_ISREG(st.st_mode))
        rc = -EMEDIUMTYPE;
    else if ((uint64_t)st.st_size > len)
        rc = -EFBIG;
    else if ((uint64_t)st.st_size < len)
        rc = -ENODATA, remove = 1;
    /* a regular file: O_NONBLOCK did its job (no FIFO wait); FUSE and network file
     * systems see the flag, so reads go blocking, as they would have */
    else if (fcntl(fd, F_SETFL, direct ? O_DIRECT : 0) != 0)
        rc = -errno;
    else if ((b->flags & MPT_CHECKSUM) &&
             (rc = mpt_record_of(fd, &want, &present)) != 0)
        remove = rc == -EBADMSG;
    else {
        rc = mpt_read_block(fd, dst, len, direct && !b->memory_fs, present, &got_crc);
        if (rc == -ENODATA)
            remove = 1; /* shrank while we read */
        else if (rc == 0 && present && got_crc != want)
            rc = -EBADMSG, remove = 1;
        else if (rc == 0 && (b->flags & MPT_TOUCH))
            mpt_touch(fd);
    }
    if (remove)
        mpt_remove_if_same_fd(b->root, rel, b->flags, fd);
    close(fd);
    return rc;
}

/* -- store ------------------------------------------------------------------------------ */

/* Write the block to fd; with check, set the record on fd afterwards. When the write is
 * a CPU copy, each chunk is checksummed just before it is copied out, so the copy reads
 * it from cache; a device's direct write is checksummed while the device reads it
 * (direct.c), or whole before it where AIO is unavailable. */
static int mpt_write_block(int fd, const char *src, size_t len, int whole, int check)
{
    uint32_t crc = 0;
    size_t done = 0;
    int rc;

    if (check && whole && (rc = mpt_direct_write_crc(fd, src, len, &crc)) != MPT_NO_AIO) {
        /* written, and checksummed while the device read it */
    } else if (!check || whole) {
        if (check)
            crc = mpt_crc32c(0, src, len, MPT_CRC32C_BEST);
        rc = mpt_write_all(fd, src, len);
    } else {
        for (rc = 0; rc == 0 && done < len; done += MPT_CHUNK_BYTES) {
            size_t part = len - done < MPT_CHUNK_BYTES ? len - done : MPT_CHUNK_BYTES;
            crc = mpt_crc32c(crc, src + done, part, MPT_CRC32C_BEST);
            rc = mpt_write_all(fd, src + done, part);
        }
    }
    if (rc == 0 && check)
        rc = mpt_set_record(fd, crc);
    return rc;
}

/* "<leaf>.<tag>.<counter>.tmp" into out (NAME_MAX + 1 bytes): 0 or -ENAMETOOLONG. */
int mpt_temp_name(char *out, size_t size, const char *leaf, const char *tag)
{
    int w = snprintf(out, size, "%s.%s.%llu.tmp", leaf, tag,
                     (unsigned long long)mpt_next_counter());
    return w < 0 || (size_t)w >= size ? -ENAMETOOLONG : 0;
}

void mpt_unlink_temp(struct mpt_batch *b, int dirfd, const char *tmp)
{
    if (unlinkat(dirfd, tmp, 0) != 0 && errno != ENOENT && b->tmp_errno == 0)
        b->tmp_errno = errno; /* left behind: the caller says so, a sweeper removes it */
}

static int mpt_store_named(struct mpt_batch *b, int dirfd, const char *leaf,
                           const char *src, size_t len, int direct)
{
    char tmp[NAME_MAX + 1];
    int oflags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | (direct ? O_DIRECT : 0);
    int fd = -EEXIST, rc, tries;

    for (tries = 0; fd == -EEXIST && tries < MPT_NAME_TRIES; tries++) {
        int rc = mpt_temp_name(tmp, sizeof tmp, leaf, b->tag);
        if (rc != 0)
            return rc;
        fd = mpt_openat(dirfd, tmp, oflags, 0644);
    }
    if (fd < 0) {
        if (fd == -EINVAL && direct) /* the kernel may create it before refusing O_DIRECT */
            mpt_unlink_temp(b, dirfd, tmp);
        return fd;
    }
    rc = mpt_write_block(fd, src, len, direct && !b->memory_fs, b->flags & MPT_CHECKSUM);
    if (close(fd) != 0 && rc == 0)
        rc = -errno; /* network file systems may report a failed write here */
    if (rc == 0) {
        if (renameat(dirfd, tmp, dirfd, leaf) == 0)
            return 0;
        rc = errno == EEXIST ? 0 : -errno; /* EEXIST: another writer published it */
    }
    mpt_unlink_temp(b, dirfd, tmp);
    return rc;
}

int mpt_link_tmpfile(int fd, int dirfd, const char *leaf)
{
    char proc[64];

    if (!__atomic_load_n(&mpt_empty_path_refused, __ATOMIC_RELAXED)) {
        if (linkat(fd, "", dirfd, leaf, AT_EMPTY_PATH) == 0)
            return 0;
        if (errno != ENOENT && errno != EPERM)
            return -errno;
        /* AT_EMPTY_PATH wants CAP_DAC_READ_SEARCH: the /proc link below does not */
    }
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    if (linkat(AT_FDCWD, proc, dirfd, leaf, AT_SYMLINK_FOLLOW) != 0)
        return -errno;
    __atomic_store_n(&mpt_empty_path_refused, 1, __ATOMIC_RELAXED);
    return 0;
}

static int mpt_store_tmpfile(struct mpt_batch *b, int dirfd, const char *leaf,
                             const char *src, size_t len, int direct)
{
    int fd = mpt_openat(dirfd, ".", O_TMPFILE | O_WRONLY | (direct ? O_DIRECT : 0), 0644);
    int rc;

    if (fd == -EOPNOTSUPP || fd == -EISDIR || fd == -EINVAL)
        return MPT_USE_NAMED; /* no O_TMPFILE here (or not with O_DIRECT) */
    if (fd < 0)
        return fd;
    rc = mpt_write_block(fd, src, len, direct && !b->memory_fs, b->flags & MPT_CHECKSUM);
    if (rc == 0) {
        rc = mpt_link_tmpfile(fd, dirfd, leaf);
        if (rc == -EEXIST)
            rc = 0; /* another writer published it */
    }
    if (close(fd) != 0 && rc == 0)
        rc = -errno;
    return rc;
}

static int mpt_store_in(struct mpt_batch *b, int dirfd, const char *leaf, const char *src,
                        size_t len, int direct, int fresh)
{
    struct stat st;
    int rc;

    if (fresh) {
        /* this store made the folder a moment ago: no block can be there but another
         * writer's copy of this one, which publishing keeps (EEXIST) or replaces with
         * the same bytes -- as if that writer had finished just after a check */
    } else if (fstatat(dirfd, leaf, &st, AT_SYMLINK_NOFOLLOW) == 0) {
        if (S_ISREG(st.st_mode) && (uint64_t)st.st_size == len) {
            if (b->flags & MPT_TOUCH)
                mpt_touch_at(dirfd, leaf);
            return 0; /* names are content hashes: an existing block holds this one */
        }
        if (S_ISREG(st.st_mode) && (uint64_t)st.st_size > len)
            return -EFBIG;
        if (!S_ISREG(st.st_mode) && !S_ISLNK(st.st_mode))
            return -EMEDIUMTYPE;
        if (S_ISLNK(st.st_mode)) {
            rc = mpt_unlink_symlink(dirfd, leaf);
            if (rc != 0)
                return rc;
        } else { /* a short file is corrupt: remove it, unless it was replaced */
            struct stat again;
            if (fstatat(dirfd, leaf, &again, AT_SYMLINK_NOFOLLOW) == 0 &&
                again.st_dev == st.st_dev && again.st_ino == st.st_ino &&
                unlinkat(dirfd, leaf, 0) != 0 && errno != ENOENT)
                return -errno;
        }
    } else if (errno != ENOENT) {
        return -errno;
    }
    if (b->flags & MPT_TMPFILE) {
        rc = mpt_store_tmpfile(b, dirfd, leaf, src, len, direct);
        if (rc != MPT_USE_NAMED)
            return rc;
    }
    return mpt_store_named(b, dirfd, leaf, src, len, direct);
}

/* Store one block. -EINVAL with direct set may be O_DIRECT's doing: the caller then
 * redoes the block buffered. A temporary file never outlives a failure (if removing it
 * fails, b->tmp_errno says so). */
int mpt_store_one(struct mpt_batch *b, const char *rel, char *src, size_t len, int direct)
{
    const char *leaf = mpt_leaf(rel);
    int tries, rc = 0;

    for (tries = 0; tries <= MPT_MKDIR_TRIES; tries++) {
        int made = 0;
        int dirfd = mpt_open_parent_made(b->root, rel, b->flags, 1, &made);
        if (dirfd == -ENOENT) {
            rc = dirfd; /* a caretaker removed an empty parent while we made its child */
            continue;
        }
        if (dirfd < 0)
            return dirfd;
        rc = mpt_store_in(b, dirfd, leaf, src, len, direct, made);
        mpt_close_dir(dirfd, b->root);
        if (rc != -ENOENT)
            break; /* ENOENT: the folder was removed under us; make it again */
    }
    return rc;
}

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 /* Linux 5.14+ */
#endif
#define MPT_PAGEMAP_PRESENT (1ULL << 63)

static pthread_mutex_t mpt_pagemap_lock = PTHREAD_MUTEX_INITIALIZER;
static int mpt_pagemap_fd = -1;
static pid_t mpt_pagemap_pid;

/* Whether the first and the last page of [start, end) (page-aligned) are mapped in this
 * process, from /proc/self/pagemap (its present bit needs no privilege); 0 when it cannot
 * tell. Two pages stand for the slot: a slot is mapped whole (the worker's pre-fault of
 * the resident buffer, or an earlier copy into it), and reading every entry cost 0.12 µs
 * a page -- half the copy's CPU -- where the bench never needed a populate. */
static int mpt_ends_mapped(uintptr_t start, uintptr_t end, long page)
{
    uint64_t first = 0, last = 0;
    size_t w = sizeof first;
    int ok;

    pthread_mutex_lock(&mpt_pagemap_lock);
    if (mpt_pagemap_pid != getpid()) { /* a forked child: "self" was the parent's */
        if (mpt_pagemap_fd >= 0)
            close(mpt_pagemap_fd);
        mpt_pagemap_fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
        mpt_pagemap_pid = getpid();
    }
    ok = mpt_pagemap_fd >= 0 &&
         pread(mpt_pagemap_fd, &first, w, (off_t)(start / (uintptr_t)page * w)) == (ssize_t)w &&
         pread(mpt_pagemap_fd, &last, w, (off_t)((end - 1) / (uintptr_t)page * w)) == (ssize_t)w;
    pthread_mutex_unlock(&mpt_pagemap_lock);
    return ok && (first & last & MPT_PAGEMAP_PRESENT) != 0;
}

int mpt_map_slot(char *p, size_t len)
{
    static long page;
    uintptr_t start, end;
    if (page == 0)
        page = sysconf(_SC_PAGESIZE);
    start = (uintptr_t)p & ~(uintptr_t)(page - 1);
    end = ((uintptr_t)p + len + (uintptr_t)page - 1) & ~(uintptr_t)(page - 1);
    if (mpt_ends_mapped(start, end, page))
        return 0;
    (void)madvise((void *)start, end - start, MADV_POPULATE_READ); /* a hint: faults do the rest */
    return 1;
}

/* -- batches ------------------------------------------------------------------------------ */

typedef int (*mpt_block_fn)(struct mpt_batch *b, const char *rel, char *p, size_t len,
                            int direct);

static int mpt_batch(mpt_block_fn one, struct mpt_batch *b, const char *paths_blob, size_t n,
                     char *base, const uint64_t *offsets, size_t block_bytes,
                     size_t *n_done, size_t *fail_index)
{
    const char *path = paths_blob;
    size_t i;

    *n_done = 0;
    *fail_index = n;
    for (i = 0; i < n; i++) {
        char *p = base + offsets[i];
        char *io = b->bounce != NULL ? b->bounce : p; /* a bounced load reads there */
        int direct = mpt_direct_ok(b->flags, io, block_bytes);
        int rc = one(b, path, io, block_bytes, direct);
        if (rc == -EINVAL && direct)
            rc = one(b, path, io, block_bytes, 0); /* never fail a block over O_DIRECT */
        if (rc != 0) {
            *fail_index = i;
            return rc;
        }
        if (io != p) {
            mpt_map_slot(p, block_bytes);
            memcpy(p, io, block_bytes); /* only after the read returned */
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
        rc = mpt_batch(store ? mpt_store_one : mpt_load_one, b, paths_blob, inside, base,
                       offsets, block_bytes, n_done, fail_index);
    if (rc == 0 && inside < n) {
        *n_done = inside;
        *fail_index = inside;
        rc = -EINVAL;
    }
    return rc;
}

int mpt_batch_store(int root, const char *paths_blob, size_t n, char *base, size_t base_len,
                    const uint64_t *offsets, size_t block_bytes, int flags, const char *tag,
                    size_t *n_done, size_t *fail_index, int *tmp_unlink_errno)
{
    struct mpt_batch b = {root, flags, tag, 0, mpt_memory_fs(root, flags)};
    int rc = mpt_batch_inside(1, &b, paths_blob, n, base, base_len, offsets, block_bytes,
                              n_done, fail_index);

    *tmp_unlink_errno = b.tmp_errno;
    return rc;
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

static uint8_t mpt_lookup_one(int root, const char *rel, size_t block_bytes, int flags)
{
    struct stat st;
    int fd = mpt_open_beneath(root, rel, O_PATH, flags), rc;

    if (fd < 0)
        return fd == -ELOOP ? MPT_LOOKUP_SYMLINK
               : fd == -ENOTDIR ? MPT_LOOKUP_BAD : MPT_LOOKUP_ABSENT;
    rc = fstat(fd, &st);
    close(fd);
    if (rc != 0)
        return MPT_LOOKUP_ABSENT;
    if (S_ISLNK(st.st_mode)) {
        int dirfd = mpt_open_parent(root, rel, flags, 0);
        if (dirfd >= 0) {
            (void)mpt_unlink_symlink(dirfd, mpt_leaf(rel));
            mpt_close_dir(dirfd, root);
        }
        return MPT_LOOKUP_SYMLINK;
    }
    if (!S_ISREG(st.st_mode) || (uint64_t)st.st_size > block_bytes)
        return MPT_LOOKUP_BAD;
    return (uint64_t)st.st_size == block_bytes ? MPT_LOOKUP_PRESENT : MPT_LOOKUP_SHORT;
}

int mpt_batch_lookup(int root, const char *paths_blob, size_t n, size_t block_bytes,
                     int flags, uint8_t *out)
{
    const char *path = paths_blob;
    for (size_t i = 0; i < n; i++) {
        out[i] = mpt_lookup_one(root, path, block_bytes, flags);
        path += strlen(path) + 1;
    }
    return 0;
}


