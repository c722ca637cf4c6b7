/*
 * mptier_io.c - batch block I/O for mptier, in plain C.
 *
 * One call stores, loads or checks a whole batch of fixed-size blocks. The caller
 * (cffi, with the GIL released) hands over raw pointers only:
 *
 *   paths_blob   n NUL-terminated paths back to back ("a\0b\0c\0")
 *   base         start of the caller's buffer; block i lives at base + offsets[i]
 *   block_bytes  size of every block
 *
 * Every function returns 0 or -errno and never touches a Python object. A batch stops
 * at its first failing block: *n_done blocks (0 .. *fail_index - 1) completed, block
 * *fail_index failed with the returned errno, later blocks were not attempted.
 *
 * Store publishes each block through a temporary file in the same directory,
 * "<final>.<pid>.<tid>.<counter>.tmp", created with O_EXCL and renamed onto the final
 * name, so no reader ever sees a partial file at a final name. The engine removes a
 * dead worker's leftovers by the pid in that name, so the format is part of the
 * contract. mptier/native/_pure.py is the Python twin of this file and must keep the
 * same behaviour, step for step.
 *
 * The file is compiled by cffi (build_ffi.py passes its text to set_source); it has no
 * header: build_ffi.py's cdef is the declaration.
 */

#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* O_DIRECT */
#endif

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#ifndef O_DIRECT
#define O_DIRECT 0 /* no direct I/O on this platform: every block goes buffered */
#endif

/* flags bit: use O_DIRECT for blocks whose address and size are aligned */
#define MPT_O_DIRECT 1
/* Alignment O_DIRECT needs for the user address, the length and the file offset.
 * 4096 covers both 512-byte and 4 KiB logical sectors. */
#define MPT_DIRECT_ALIGN 4096
/* Creating the parent directories and retrying the open can lose a race against a
 * process that removes empty directories; a few rounds are plenty. */
#define MPT_MKDIR_TRIES 3
/* A temporary name already taken (left by a crashed writer that reused our pid and
 * tid) is skipped by taking the next counter value. */
#define MPT_NAME_TRIES 8

static unsigned long mpt_counter;

static unsigned long mpt_next_counter(void)
{
    return __atomic_fetch_add(&mpt_counter, 1, __ATOMIC_RELAXED);
}

static long mpt_tid(void)
{
    return (long)syscall(SYS_gettid);
}

static int mpt_tmp_name(char *out, size_t size, const char *final)
{
    int len = snprintf(out, size, "%s.%ld.%ld.%lu.tmp", final, (long)getpid(), mpt_tid(),
                       mpt_next_counter());
    return (len < 0 || (size_t)len >= size) ? -ENAMETOOLONG : 0;
}

static int mpt_direct_ok(int flags, const char *p, size_t len)
{
    return O_DIRECT != 0 && (flags & MPT_O_DIRECT) &&
           (((uintptr_t)p | (uintptr_t)len) % MPT_DIRECT_ALIGN) == 0;
}

/* mkdir -p on a writable copy of a directory path; an existing entry is fine (if it is
 * not a directory, the caller's next open says so with ENOTDIR). */
static int mpt_mkdirs(char *dir)
{
    char *slash;
    int rc;

    if (mkdir(dir, 0777) == 0 || errno == EEXIST)
        return 0;
    if (errno != ENOENT)
        return -errno;
    slash = strrchr(dir, '/');
    while (slash != NULL && slash > dir && slash[-1] == '/')
        slash--;
    if (slash == NULL || slash == dir)
        return -ENOENT;
    *slash = '\0';
    rc = mpt_mkdirs(dir);
    *slash = '/';
    if (rc != 0)
        return rc;
    if (mkdir(dir, 0777) == 0 || errno == EEXIST)
        return 0;
    return -errno;
}

static int mpt_make_parent(const char *path)
{
    char dir[PATH_MAX];
    const char *slash = strrchr(path, '/');
    size_t len;

    if (slash == NULL || slash == path)
        return -ENOENT; /* "x" or "/x": the parent exists, so ENOENT stands */
    len = (size_t)(slash - path);
    if (len >= sizeof dir)
        return -ENAMETOOLONG;
    memcpy(dir, path, len);
    dir[len] = '\0';
    return mpt_mkdirs(dir);
}

static int mpt_write_all(int fd, const char *p, size_t len)
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

static int mpt_open(const char *path, int oflags, mode_t mode)
{
    int fd;
    do
        fd = open(path, oflags | O_CLOEXEC, mode);
    while (fd < 0 && errno == EINTR);
    return fd < 0 ? -errno : fd;
}

/* Store one block. -EINVAL with direct set may be O_DIRECT's doing: the caller then
 * redoes the block buffered. The temporary file never outlives a failure. */
static int mpt_store_one(const char *path, const char *src, size_t len, int direct)
{
    char tmp[PATH_MAX];
    int oflags = O_WRONLY | O_CREAT | O_EXCL | (direct ? O_DIRECT : 0);
    int fd, rc, mkdir_tries = 0, name_tries = 0;

    if (access(path, F_OK) == 0)
        return 0; /* names are content hashes: an existing file holds this block */
    for (;;) {
        rc = mpt_tmp_name(tmp, sizeof tmp, path);
        if (rc != 0)
            return rc;
        fd = mpt_open(tmp, oflags, 0644);
        if (fd >= 0)
            break;
        if (fd == -EINVAL && direct) {
            /* The kernel may create the file before it refuses O_DIRECT. The name
             * is ours alone (O_EXCL would have said EEXIST otherwise). */
            unlink(tmp);
            return -EINVAL;
        }
        if (fd == -ENOENT && mkdir_tries++ < MPT_MKDIR_TRIES) {
            rc = mpt_make_parent(path);
            if (rc != 0)
                return rc;
            continue;
        }
        if (fd == -EEXIST && name_tries++ < MPT_NAME_TRIES)
            continue;
        return fd;
    }
    rc = mpt_write_all(fd, src, len);
    if (close(fd) != 0 && rc == 0)
        rc = -errno; /* network file systems may report a failed write here */
    if (rc == 0) {
        if (rename(tmp, path) == 0)
            return 0;
        rc = errno == EEXIST ? 0 : -errno; /* EEXIST: another writer published it */
    }
    unlink(tmp);
    return rc;
}

/* Remove a file we found short, unless the name meanwhile points at another file
 * (a writer may have just published a whole copy over it). */
static void mpt_remove_if_same(int fd, const char *path)
{
    struct stat held, named;
    if (fstat(fd, &held) == 0 && stat(path, &named) == 0 && held.st_dev == named.st_dev &&
        held.st_ino == named.st_ino)
        unlink(path);
}

static int mpt_load_one(const char *path, char *dst, size_t len, int direct)
{
    ssize_t got;
    int fd = mpt_open(path, O_RDONLY | (direct ? O_DIRECT : 0), 0);

    if (fd < 0)
        return fd;
    got = mpt_read_full(fd, dst, len);
    if (got >= 0 && (size_t)got < len) {
        mpt_remove_if_same(fd, path);
        got = -ENODATA; /* a short file is corrupt */
    }
    close(fd);
    return got < 0 ? (int)got : 0;
}

typedef int (*mpt_block_fn)(const char *path, char *p, size_t len, int direct);

static int mpt_store_block(const char *path, char *p, size_t len, int direct)
{
    return mpt_store_one(path, p, len, direct);
}

static int mpt_batch(mpt_block_fn one, const char *paths_blob, size_t n, char *base,
                     const uint64_t *offsets, size_t block_bytes, int flags, size_t *n_done,
                     size_t *fail_index)
{
    const char *path = paths_blob;
    size_t i;

    *n_done = 0;
    *fail_index = n;
    for (i = 0; i < n; i++) {
        char *p = base + offsets[i];
        int direct = mpt_direct_ok(flags, p, block_bytes);
        int rc = one(path, p, block_bytes, direct);
        if (rc == -EINVAL && direct)
            rc = one(path, p, block_bytes, 0); /* never fail a block over O_DIRECT */
        if (rc != 0) {
            *fail_index = i;
            return rc;
        }
        *n_done = i + 1;
        path += strlen(path) + 1;
    }
    return 0;
}

int mpt_batch_store(const char *paths_blob, size_t n, char *base, const uint64_t *offsets,
                    size_t block_bytes, int flags, size_t *n_done, size_t *fail_index)
{
    return mpt_batch(mpt_store_block, paths_blob, n, base, offsets, block_bytes, flags,
                     n_done, fail_index);
}

int mpt_batch_load(const char *paths_blob, size_t n, char *base, const uint64_t *offsets,
                   size_t block_bytes, int flags, size_t *n_done, size_t *fail_index)
{
    return mpt_batch(mpt_load_one, paths_blob, n, base, offsets, block_bytes, flags, n_done,
                     fail_index);
}

int mpt_batch_exists(const char *paths_blob, size_t n, uint8_t *out)
{
    const char *path = paths_blob;
    size_t i;

    for (i = 0; i < n; i++) {
        out[i] = access(path, F_OK) == 0;
        path += strlen(path) + 1;
    }
    return 0;
}

/* 1: O_DIRECT works in dir; 0: it does not (EINVAL); -errno: dir is unusable. */
int mpt_probe_o_direct(const char *dir)
{
    char path[PATH_MAX];
    void *page = NULL;
    int fd, rc, len;

    if (O_DIRECT == 0)
        return 0;
    len = snprintf(path, sizeof path, "%s/.mpt_odirect_probe.%ld.%ld.%lu.tmp", dir,
                   (long)getpid(), mpt_tid(), mpt_next_counter());
    if (len < 0 || (size_t)len >= sizeof path)
        return -ENAMETOOLONG;
    if (posix_memalign(&page, MPT_DIRECT_ALIGN, MPT_DIRECT_ALIGN) != 0)
        return -ENOMEM;
    memset(page, 0, MPT_DIRECT_ALIGN);
    fd = mpt_open(path, O_WRONLY | O_CREAT | O_EXCL | O_DIRECT, 0644);
    if (fd < 0) {
        rc = fd == -EINVAL ? 0 : fd;
        if (fd == -EINVAL)
            unlink(path); /* the kernel may have created it before refusing */
    } else {
        rc = mpt_write_all(fd, page, MPT_DIRECT_ALIGN);
        rc = rc == 0 ? 1 : rc == -EINVAL ? 0 : rc;
        close(fd);
        unlink(path);
    }
    free(page);
    return rc;
}
