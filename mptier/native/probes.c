/*
 * probes.c - what a directory's file system supports, asked once per root.
 *
 * Each probe takes a directory path, answers 1 (works), 0 (refused by the file system)
 * or -errno (the directory itself is unusable), and leaves no file behind. While a probe's
 * file has its name (.mpt_probe.<pid>.<n>.tmp) the probe holds its flock, so a sweeper
 * (mptier.storage.leases.TempSweeper) can tell a prober killed mid-probe from a live one.
 * mpt_same_folder is asked once per run of keys instead: is the root still the folder
 * the worker opened?
 */

#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* O_DIRECT, O_TMPFILE, O_PATH */
#endif

#include "mptier_native.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/xattr.h>
#include <unistd.h>

/* Hold the probe file's flock (best effort: a sweeper that wins the few instructions
 * between the open and this lock removes a name the probe no longer needs, since it
 * works on its descriptor; a file system without locks judges probe files by age). */
static void mpt_probe_lock(int fd)
{
    (void)flock(fd, LOCK_EX | LOCK_NB);
}

static int mpt_probe_file(const char *dir, int oflags, char *path, size_t size)
{
    int len = snprintf(path, size, "%s/.mpt_probe.%ld.%llu.tmp", dir, (long)getpid(),
                       (unsigned long long)mpt_next_counter());
    int fd;
    if (len < 0 || (size_t)len >= size)
        return -ENAMETOOLONG;
    do
        fd = open(path, oflags | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    while (fd < 0 && errno == EINTR);
    if (fd < 0)
        return -errno;
    mpt_probe_lock(fd);
    return fd;
}

/* 1: O_DIRECT works in dir; 0: it does not (EINVAL); -errno: dir is unusable. */
int mpt_probe_o_direct(const char *dir)
{
    char path[PATH_MAX];
    void *page = NULL;
    int fd, rc;

    if (O_DIRECT == 0)
        return 0;
    if (posix_memalign(&page, MPT_DIRECT_ALIGN, MPT_DIRECT_ALIGN) != 0)
        return -ENOMEM;
    memset(page, 0, MPT_DIRECT_ALIGN);
    fd = mpt_probe_file(dir, O_WRONLY | O_DIRECT, path, sizeof path);
    if (fd < 0) {
        rc = fd == -EINVAL ? 0 : fd;
        if (fd == -EINVAL)
            unlink(path); /* the kernel may have created it before refusing */
    } else {
        rc = mpt_write_at(fd, page, MPT_DIRECT_ALIGN, MPT_AT_POSITION);
        rc = rc == 0 ? 1 : rc == -EINVAL ? 0 : rc;
        close(fd);
        unlink(path);
    }
    free(page);
    return rc;
}

/* 1: a user extended attribute (the checksum record) can be set and read back on a file
 * in dir; 0: the file system refuses user attributes; -errno: dir is unusable. */
int mpt_probe_xattr(const char *dir)
{
    char path[PATH_MAX];
    unsigned char back[4];
    int fd = mpt_probe_file(dir, O_WRONLY, path, sizeof path), rc;

    if (fd < 0)
        return fd;
    rc = mpt_set_record(fd, 0xE3069283u);
    if (rc == 0)
        rc = fgetxattr(fd, MPT_XATTR_NAME, back, sizeof back) == 4 ? 1 : -errno;
    if (rc == -ENOTSUP || rc == -EPERM)
        rc = 0;
    close(fd);
    unlink(path);
    return rc;
}

/* 1: an O_TMPFILE file can be made in dir and linked into place; 0: refused; -errno:
 * dir is unusable. The probe links under a probe name and removes it again. */
int mpt_probe_o_tmpfile(const char *dir)
{
    char path[PATH_MAX];
    char byte = 0;
    int dirfd = open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC), fd, rc, check;
    int len;

    if (dirfd < 0)
        return -errno;
    fd = mpt_openat(dirfd, ".", O_TMPFILE | O_WRONLY, 0644);
    if (fd < 0) {
        close(dirfd);
        return fd == -EOPNOTSUPP || fd == -EISDIR || fd == -EINVAL ? 0 : fd;
    }
    mpt_probe_lock(fd); /* locked before it has a name */
    rc = mpt_write_at(fd, "m", 1, MPT_AT_POSITION);
    len = snprintf(path, sizeof path, ".mpt_probe.%ld.%llu.tmp", (long)getpid(),
                   (unsigned long long)mpt_next_counter());
    if (rc == 0)
        rc = len < 0 || (size_t)len >= sizeof path ? -ENAMETOOLONG
                                                   : mpt_link_tmpfile(fd, dirfd, path);
    close(fd);
    if (rc == 0) {
        /* Published is not enough: some FUSE file systems (JuiceFS 1.4) name the file,
         * then drop its inode when the O_TMPFILE descriptor closes. Only a name that
         * still reads back after the close proves the way works. */
        check = openat(dirfd, path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
        if (check >= 0)
            mpt_probe_lock(check); /* unlocked since the close: leases.PROBE_TEMP_GRACE_S */
        rc = check >= 0 && read(check, &byte, 1) == 1 && byte == 'm' ? 1 : 0;
        if (check >= 0)
            close(check);
        (void)unlinkat(dirfd, path, 0);
    } else if (rc == -EPERM || rc == -ENOENT || rc == -EOPNOTSUPP) {
        rc = 0; /* no way to link it here (no /proc, no capability) */
    }
    close(dirfd);
    return rc;
}

/* 1: dir's file system keeps file data in memory (tmpfs, ramfs): a block's I/O is a
 * CPU copy there, so more requests in flight do not make it faster; 0: it does not;
 * -errno: dir is unusable. */
int mpt_fs_in_memory(const char *dir)
{
    struct statfs sf;
    if (statfs(dir, &sf) != 0)
        return -errno;
    return (unsigned long)sf.f_type == MPT_TMPFS_MAGIC ||
           (unsigned long)sf.f_type == MPT_RAMFS_MAGIC;
}

/* 1: path leads to a directory whose device and inode are dev and ino; 0: it leads to
 * something else; -errno: stat fails. A worker's check, before each run of keys on a
 * root, that the root is still the folder it opened (mptier.workers.rootgate): one
 * system call, without the Python stat result's 20 fields. */
int mpt_same_folder(const char *path, uint64_t dev, uint64_t ino)
{
    struct stat st;
    if (stat(path, &st) != 0)
        return -errno;
    return S_ISDIR(st.st_mode) && (uint64_t)st.st_dev == dev && (uint64_t)st.st_ino == ino;
}

const char *mpt_xattr_name(void)
{
    return MPT_XATTR_NAME;
}
