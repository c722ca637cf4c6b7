/*
 * block.c - one block the system-call way: load it, store it, evict it, look it up, and
 * its checksum record.
 *
 * mpt_load_one and mpt_store_one do for one block what the table of cases at the top of
 * mptier_io.c says, one system call after another. The batch loop (mptier_io.c) runs
 * them block by block; the io_uring path (uring.c) hands them every block whose path
 * meets anything unusual, and shares the helpers below them (temporary names, the
 * checksum record, linking an O_TMPFILE file into place, touching atime), as probes.c
 * does. A checksummed O_DIRECT transfer is overlapped with its CRC by direct.c.
 */

#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* O_DIRECT, O_TMPFILE, AT_EMPTY_PATH, UTIME_* */
#endif

#include "mptier_native.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <string.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/xattr.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif


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
        rc = mpt_write_at(fd, src, len, MPT_AT_POSITION);
    } else {
        for (rc = 0; rc == 0 && done < len; done += MPT_CHUNK_BYTES) {
            size_t part = len - done < MPT_CHUNK_BYTES ? len - done : MPT_CHUNK_BYTES;
            crc = mpt_crc32c(crc, src + done, part, MPT_CRC32C_BEST);
            rc = mpt_write_at(fd, src + done, part, MPT_AT_POSITION);
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
            b->found_one = 1;
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

/* -- evict ----------------------------------------------------------------------------- */

/* rmdir the folder that holds path (its last component cut off), then that folder's
 * parent: the <h2>_g<group> and <h3> folders of the layout where the removal emptied
 * them. Any failure (not empty, gone, refused) keeps that folder and stops. */
static void mpt_remove_empty_parents(const char *path)
{
    char folder[PATH_MAX];
    size_t len = strlen(path);
    char *cut;

    if (len >= sizeof folder)
        return;
    memcpy(folder, path, len + 1);
    for (int level = 0; level < 2; level++) {
        cut = strrchr(folder, '/');
        if (cut == NULL || cut == folder)
            return;
        *cut = '\0';
        if (rmdir(folder) != 0)
            return;
    }
}

int mpt_evict_block(const char *path, uint64_t size, uint64_t ino, int64_t atime_ns,
                    int told)
{
    struct stat st;
    int64_t seen_ns;

    if (lstat(path, &st) != 0)
        /* a told block is only a guess at a file: any failure to look keeps it */
        return told || errno == ENOENT ? 0 : -errno;
    seen_ns = (int64_t)st.st_atim.tv_sec * 1000000000 + st.st_atim.tv_nsec;
    if (!S_ISREG(st.st_mode) || (uint64_t)st.st_size != size)
        return 0;
    if (told ? seen_ns > atime_ns : (uint64_t)st.st_ino != ino || seen_ns != atime_ns)
        return 0; /* used since it was chosen, or another file now */
    if (unlink(path) != 0)
        return errno == ENOENT ? 0 : -errno;
    mpt_remove_empty_parents(path);
    return 1;
}

/* -- the caller's slots ---------------------------------------------------------------- */

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 /* Linux 5.14+ */
#endif
#define MPT_PAGEMAP_PRESENT (1ULL << 63)

static pthread_mutex_t mpt_pagemap_lock = PTHREAD_MUTEX_INITIALIZER;
static int mpt_pagemap_fd = -1;
static pid_t mpt_pagemap_pid;

/* pthread_atfork: the lock is held across fork, so the child never inherits it locked by
 * a thread it does not have (its first bounced copy would wait forever); in the child the
 * inherited descriptor is closed while its number is still ours (closed at the child's
 * first use, the number may be another file by then). */
static void mpt_pagemap_prefork(void)
{
    pthread_mutex_lock(&mpt_pagemap_lock);
}

static void mpt_pagemap_parent(void)
{
    pthread_mutex_unlock(&mpt_pagemap_lock);
}

static void mpt_pagemap_forked(void)
{
    if (mpt_pagemap_fd >= 0)
        close(mpt_pagemap_fd);
    mpt_pagemap_fd = -1;
    pthread_mutex_unlock(&mpt_pagemap_lock);
}

/* Registered when the library is loaded: registering at the first use, under the lock,
 * left a fork in another thread at that moment with the lock held and no handler. */
__attribute__((constructor)) static void mpt_pagemap_at_load(void)
{
    (void)pthread_atfork(mpt_pagemap_prefork, mpt_pagemap_parent, mpt_pagemap_forked);
}

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
    if (mpt_pagemap_pid != getpid()) { /* first use, or a forked child (closed at fork) */
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

/* Blocks at least this long are copied into their slots with streaming stores; a shorter
 * one may as well leave its lines in the caches for whoever reads it next. */
#define MPT_STREAM_MIN_BYTES (64u << 10)

void mpt_copy_to_slot(char *dst, const char *src, size_t len)
{
#if defined(__x86_64__)
    if (len >= MPT_STREAM_MIN_BYTES && ((uintptr_t)dst & 15) == 0) {
        size_t body = len & ~(size_t)63, o;
        for (o = 0; o < body; o += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + o));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + o + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + o + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + o + 48));
            _mm_stream_si128((__m128i *)(dst + o), a);
            _mm_stream_si128((__m128i *)(dst + o + 16), b);
            _mm_stream_si128((__m128i *)(dst + o + 32), c);
            _mm_stream_si128((__m128i *)(dst + o + 48), d);
        }
        _mm_sfence(); /* the streamed lines reach memory before anything stored after */
        memcpy(dst + body, src + body, len - body);
        return;
    }
#endif
    memcpy(dst, src, len);
}

/* -- lookup ------------------------------------------------------------------------------ */

/* The lookup answer for rel, given what opening it O_PATH beneath root gave (a
 * descriptor, which this closes, or -errno): the loop's rules, one home for both paths
 * (the loop's own open below, io_uring's OPENAT2 in uring.c). */
uint8_t mpt_lookup_opened(int root, const char *rel, int fd, size_t block_bytes,
                          int flags)
{
    struct stat st;
    int rc;

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

uint8_t mpt_lookup_one(int root, const char *rel, size_t block_bytes, int flags)
{
    return mpt_lookup_opened(root, rel, mpt_open_beneath(root, rel, O_PATH, flags),
                             block_bytes, flags);
}
