/*
 * resolve.c - reaching a path beneath the root without following a symlink.
 *
 * Every open of the native core under a root goes through here. Where the kernel has
 * openat2 (Linux 5.6; probed once per process) one call resolves a whole relative path
 * with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS: it can neither leave the root nor follow
 * a link. Elsewhere, or with MPT_NO_OPENAT2, the path is walked one component at a
 * time, each folder opened O_PATH | O_DIRECTORY | O_NOFOLLOW relative to the last.
 *
 * Both say ELOOP where a symlink stands and ENOTDIR where a non-directory stands in for
 * a folder. Only the walk can tell *which* component is the link, so an ELOOP from
 * openat2 is handed to the walk, which removes the link (a block path or a layout
 * sub-folder is never legitimately a symlink) and, when creating, makes the folder.
 */

#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* O_PATH */
#endif

#include "mptier_native.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

/* openat2(2), kernel ABI (include/uapi/linux/openat2.h); not every libc declares it. */
#ifndef SYS_openat2
#define SYS_openat2 437 /* the same number on every architecture that has it */
#endif

static int mpt_openat2_ok; /* openat2 with RESOLVE_* flags works (probed once) */
static pthread_once_t mpt_openat2_once = PTHREAD_ONCE_INIT;

int mpt_openat(int dirfd, const char *name, int oflags, mode_t mode)
{
    int fd;
    do
        fd = openat(dirfd, name, oflags | O_CLOEXEC, mode);
    while (fd < 0 && errno == EINTR);
    return fd < 0 ? -errno : fd;
}

void mpt_close_dir(int dirfd, int root)
{
    if (dirfd >= 0 && dirfd != root)
        close(dirfd);
}

static void mpt_probe_openat2(void)
{
    struct mpt_open_how how = {O_PATH | O_DIRECTORY | O_CLOEXEC, 0, MPT_RESOLVE_NO_SYMLINKS};
    long fd = syscall(SYS_openat2, AT_FDCWD, "/", &how, sizeof how);
    mpt_openat2_ok = fd >= 0; /* ENOSYS (old kernel), EPERM (seccomp): use the walk */
    if (fd >= 0)
        close((int)fd);
}

int mpt_use_openat2(int flags)
{
    if (flags & MPT_NO_OPENAT2)
        return 0;
    pthread_once(&mpt_openat2_once, mpt_probe_openat2);
    return mpt_openat2_ok;
}

static int mpt_openat2(int dirfd, const char *path, int oflags, mode_t mode)
{
    struct mpt_open_how how = {(uint64_t)(oflags | O_CLOEXEC), mode,
                               MPT_RESOLVE_BENEATH | MPT_RESOLVE_NO_SYMLINKS};
    long fd;
    do
        fd = syscall(SYS_openat2, dirfd, path, &how, sizeof how);
    while (fd < 0 && errno == EINTR);
    return fd < 0 ? -errno : (int)fd;
}

/* The leaf (file name) of a relative path. */
const char *mpt_leaf(const char *rel)
{
    const char *slash = strrchr(rel, '/');
    return slash == NULL ? rel : slash + 1;
}

/* Remove the symlink dirfd/name, if it still is one. */
int mpt_unlink_symlink(int dirfd, const char *name)
{
    struct stat st;
    if (fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0)
        return errno == ENOENT ? 0 : -errno;
    if (!S_ISLNK(st.st_mode))
        return 0;
    return unlinkat(dirfd, name, 0) == 0 || errno == ENOENT ? 0 : -errno;
}

/* Open the sub-folder rel[0:len) one component at a time, following no symlink, and
 * return its descriptor (root itself for len 0; close with mpt_close_dir). A symlink
 * on the way is removed: with create the real folder is then made, without it the walk
 * fails with ELOOP. Errors: ENOENT (missing, not creating), ENOTDIR (a non-directory
 * where a folder must be), EXDEV ("..", as RESOLVE_BENEATH says), or the syscall's. */
static int mpt_walk(int root, const char *rel, size_t len, int create, int *made)
{
    char name[NAME_MAX + 1];
    const char *p = rel, *end = rel + len;
    int cur = root, rc = 0, made_here = 0;

    while (p < end) {
        const char *q = memchr(p, '/', (size_t)(end - p));
        size_t clen = (size_t)((q == NULL ? end : q) - p);
        int fd = -1, tries = 0;

        if (clen == 0) {
            p++;
            continue;
        }
        if (clen > NAME_MAX) {
            rc = -ENAMETOOLONG;
            break;
        }
        memcpy(name, p, clen);
        name[clen] = '\0';
        made_here = 0;
        if (strcmp(name, "..") == 0) {
            rc = -EXDEV;
            break;
        }
        for (;;) {
            struct stat st;
            fd = mpt_openat(cur, name, O_PATH | O_DIRECTORY | O_NOFOLLOW, 0);
            if (fd >= 0 || tries++ >= MPT_MKDIR_TRIES)
                break;
            if (fd == -ENOENT && create) {
                if (mkdirat(cur, name, 0777) == 0) {
                    made_here = 1; /* ours: new, and empty a moment ago */
                } else if (errno != EEXIST) {
                    fd = -errno;
                    break;
                }
                continue;
            }
            /* O_PATH | O_NOFOLLOW | O_DIRECTORY on a symlink says ENOTDIR: look. */
            if (fd != -ENOTDIR && fd != -ELOOP)
                break;
            if (fstatat(cur, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
                if (errno == ENOENT)
                    continue; /* changed under us: look again */
                fd = -errno;
                break;
            }
            if (!S_ISLNK(st.st_mode)) {
                if (S_ISDIR(st.st_mode))
                    continue; /* replaced by a folder meanwhile */
                fd = -ENOTDIR;
                break;
            }
            rc = mpt_unlink_symlink(cur, name);
            if (rc != 0) {
                fd = rc;
                break;
            }
            if (!create) {
                fd = -ELOOP;
                break;
            }
        }
        if (fd < 0) {
            rc = fd;
            break;
        }
        mpt_close_dir(cur, root);
        cur = fd;
        p += clen;
    }
    if (rc != 0) {
        mpt_close_dir(cur, root);
        return rc;
    }
    if (made != NULL)
        *made = made_here;
    return cur;
}

/* The folder holding rel's leaf (root for a bare name); close with mpt_close_dir. */
int mpt_open_parent(int root, const char *rel, int flags, int create)
{
    return mpt_open_parent_made(root, rel, flags, create, NULL);
}

/* mpt_open_parent, and with *made = 1 when this call made the folder itself (so it is
 * new and was empty a moment ago), else 0. */
int mpt_open_parent_made(int root, const char *rel, int flags, int create, int *made)
{
    const char *leaf = mpt_leaf(rel);
    size_t len = leaf == rel ? 0 : (size_t)(leaf - rel - 1);
    char dir[PATH_MAX];

    if (made != NULL)
        *made = 0;
    if (len == 0)
        return root;
    if (mpt_use_openat2(flags) && len < sizeof dir) {
        int fd;
        memcpy(dir, rel, len);
        dir[len] = '\0';
        fd = mpt_openat2(root, dir, O_PATH | O_DIRECTORY, 0);
        /* ENOENT when creating, ELOOP (a symlinked folder to remove), EAGAIN (a race the
         * kernel refused to judge): the walk handles each. */
        if (fd >= 0 || !(fd == -ELOOP || fd == -EAGAIN || (fd == -ENOENT && create)))
            return fd;
    }
    return mpt_walk(root, rel, len, create, made);
}

/* Open rel beneath root with oflags | O_NOFOLLOW. A symlink at a sub-folder is removed
 * and gives ELOOP; one at the leaf gives ELOOP and is removed too, except with O_PATH,
 * where the kernel hands out a descriptor of the link itself (the caller sees S_ISLNK). */
int mpt_open_beneath(int root, const char *rel, int oflags, int flags)
{
    const char *leaf = mpt_leaf(rel);
    int dirfd, fd;

    if (mpt_use_openat2(flags)) {
        fd = mpt_openat2(root, rel, oflags | O_NOFOLLOW, 0);
        if (fd != -ELOOP && fd != -EAGAIN)
            return fd;
        /* which component is the link? the walk finds and removes it */
    }
    dirfd = mpt_open_parent(root, rel, flags | MPT_NO_OPENAT2, 0);
    if (dirfd < 0)
        return dirfd;
    fd = mpt_openat(dirfd, leaf, oflags | O_NOFOLLOW, 0);
    if (fd == -ELOOP)
        (void)mpt_unlink_symlink(dirfd, leaf);
    mpt_close_dir(dirfd, root);
    return fd;
}

/* Remove rel if its name still points at the inode (dev, ino): a writer may have just
 * published a whole copy over the one we judged. */
void mpt_remove_if_same(int root, const char *rel, int flags, dev_t dev, ino_t ino)
{
    struct stat named;
    int dirfd = mpt_open_parent(root, rel, flags, 0);
    const char *leaf = mpt_leaf(rel);

    if (dirfd < 0)
        return;
    if (fstatat(dirfd, leaf, &named, AT_SYMLINK_NOFOLLOW) == 0 && named.st_dev == dev &&
        named.st_ino == ino)
        (void)unlinkat(dirfd, leaf, 0);
    mpt_close_dir(dirfd, root);
}

/* "openat2" or "walk": how paths resolve without MPT_NO_OPENAT2. */
const char *mpt_resolver(void)
{
    return mpt_use_openat2(0) ? "openat2" : "walk";
}
