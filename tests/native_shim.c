/*
 * native_shim.c - an LD_PRELOAD library for the native-layer tests: it makes the file
 * system refuse what a real one sometimes refuses, and records what the I/O code did at
 * the moment it did it. Both backends go through these libc symbols (the C core calls
 * them, CPython's os module calls them), so one shim tests both.
 *
 * SHIM_MODE is a comma-separated list of:
 *   open       an O_DIRECT open fails with EINVAL (after creating the file, as the
 *              kernel may)
 *   io         read / write / readv on an O_DIRECT descriptor fail with EINVAL, and so
 *              does an AIO submission (io_submit through syscall()) for one
 *   noaio      io_setup (through syscall()) fails with ENOSYS: no Linux AIO
 *   notmpfile  an O_TMPFILE open fails with EOPNOTSUPP (a file system without it)
 *   untmp      renameat of a "*.tmp" name fails with EIO, and unlinkat of one with EBUSY
 *   log        "excl <dir>/<name>" for each O_CREAT|O_EXCL open, "tmpfile <dir>" for each
 *              O_TMPFILE open
 *   publish    "rename <dir>/<old> <record>" before each renameat and "link <record>"
 *              before each linkat, <record> being the hex of the user.vllm.kv_crc32c
 *              attribute the file carries at that moment, or "none"
 * SHIM_LOG names the file the lines go to; "hits <n>" (refusals made) is added at exit.
 *
 * shim_fail_enter_after(n), called by the test (ctypes.CDLL(None)): the n-th
 * io_uring_enter from then on (through syscall()) fails with ENOMEM without reaching the
 * kernel -- what uring.c sees when the kernel has no memory for it; 0 disarms.
 * shim_fail_enters(n, count): the n-th and the count - 1 after it fail so;
 * shim_enter_failures_left() says how many of those are still to come.
 */

#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/aio_abi.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/xattr.h>
#include <unistd.h>

#define M_OPEN 1
#define M_IO 2
#define M_NOTMPFILE 4
#define M_UNTMP 8
#define M_LOG 16
#define M_PUBLISH 32
#define M_NOAIO 64

static int mode;
static long hits;
static long enter_countdown; /* shim_fail_enters: enters until the first failure */
static long enter_failures;  /* failures still to make once the countdown ran out */

void shim_fail_enters(long n, long count)
{
    __atomic_store_n(&enter_failures, n > 0 ? count : 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&enter_countdown, n, __ATOMIC_SEQ_CST);
}

void shim_fail_enter_after(long n)
{
    shim_fail_enters(n, 1);
}

long shim_enter_failures_left(void)
{
    return __atomic_load_n(&enter_failures, __ATOMIC_SEQ_CST);
}

/* Whether this io_uring_enter is one to fail (enter calls come from one thread at a
 * time in these tests). */
static int enter_fails(void)
{
    if (__atomic_load_n(&enter_failures, __ATOMIC_SEQ_CST) <= 0)
        return 0;
    if (__atomic_load_n(&enter_countdown, __ATOMIC_SEQ_CST) > 1) {
        __atomic_sub_fetch(&enter_countdown, 1, __ATOMIC_SEQ_CST);
        return 0;
    }
    __atomic_store_n(&enter_countdown, 0, __ATOMIC_SEQ_CST);
    __atomic_sub_fetch(&enter_failures, 1, __ATOMIC_SEQ_CST);
    return 1;
}

static void hit(void)
{
    __atomic_add_fetch(&hits, 1, __ATOMIC_RELAXED);
}

static void note(const char *fmt, ...)
{
    static int (*real_open)(const char *, int, ...);
    const char *log = getenv("SHIM_LOG");
    char line[8192];
    va_list ap;
    int fd, len;

    if (log == NULL)
        return;
    if (real_open == NULL)
        real_open = dlsym(RTLD_NEXT, "open");
    va_start(ap, fmt);
    len = vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    if (len < 0 || len >= (int)sizeof line - 1)
        return;
    line[len++] = '\n';
    fd = real_open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0) {
        if (write(fd, line, (size_t)len) < 0) {
        }
        close(fd);
    }
}

static void where(int dirfd, char *out, size_t size)
{
    char link[64];
    ssize_t n;
    if (dirfd == AT_FDCWD) {
        if (getcwd(out, size) == NULL)
            snprintf(out, size, "?");
        return;
    }
    snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
    n = readlink(link, out, size - 1);
    out[n < 0 ? 0 : n] = '\0';
}

static const char *record_hex(const char *path, int fd, char *out)
{
    unsigned char val[64];
    ssize_t n = fd >= 0 ? fgetxattr(fd, "user.vllm.kv_crc32c", val, sizeof val)
                        : getxattr(path, "user.vllm.kv_crc32c", val, sizeof val);
    if (n < 0)
        return "none";
    for (ssize_t i = 0; i < n; i++)
        sprintf(out + 2 * i, "%02x", val[i]);
    out[2 * n] = '\0';
    return out;
}

static int ends_tmp(const char *name)
{
    size_t n = strlen(name);
    return n > 4 && strcmp(name + n - 4, ".tmp") == 0;
}

__attribute__((constructor)) static void shim_init(void)
{
    const char *m = getenv("SHIM_MODE");
    static const struct {
        const char *name;
        int bit;
    } names[] = {{"open", M_OPEN},  {"io", M_IO},   {"notmpfile", M_NOTMPFILE},
                 {"untmp", M_UNTMP}, {"log", M_LOG}, {"publish", M_PUBLISH},
                 {"noaio", M_NOAIO}};
    char buf[256], *save = NULL;
    if (m == NULL)
        return;
    snprintf(buf, sizeof buf, "%s", m);
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save))
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
            if (strcmp(t, names[i].name) == 0)
                mode |= names[i].bit;
}

__attribute__((destructor)) static void shim_fini(void)
{
    note("hits %ld", hits);
}

/* -- opens ------------------------------------------------------------------------------ */

static int shim_open(const char *sym, int dirfd, const char *path, int flags, mode_t m)
{
    int (*real_at)(int, const char *, int, ...) = NULL;
    int (*real)(const char *, int, ...) = NULL;
    char dir[4096];
    int is_tmpfile = (flags & O_TMPFILE) == O_TMPFILE;

    if (dirfd == -1000)
        real = dlsym(RTLD_NEXT, sym);
    else
        real_at = dlsym(RTLD_NEXT, sym);
#define REAL(fl) (real ? real(path, (fl), m) : real_at(dirfd, path, (fl), m))
    if ((mode & M_NOTMPFILE) && is_tmpfile) {
        hit();
        errno = EOPNOTSUPP;
        return -1;
    }
    if ((mode & M_OPEN) && (flags & O_DIRECT)) {
        hit();
        if ((flags & O_CREAT) || is_tmpfile) {
            int fd = REAL(flags & ~O_DIRECT);
            if (fd < 0)
                return -1;
            close(fd);
        }
        errno = EINVAL;
        return -1;
    }
    if (mode & M_LOG) {
        where(real ? AT_FDCWD : dirfd, dir, sizeof dir);
        if ((flags & O_CREAT) && (flags & O_EXCL))
            note("excl %s/%s", path[0] == '/' ? "" : dir, path);
        else if (is_tmpfile)
            note("tmpfile %s", dir);
    }
    return REAL(flags);
#undef REAL
}

#define OPEN_WRAPPER(name)                                                              \
    int name(const char *path, int flags, ...)                                          \
    {                                                                                   \
        mode_t m = 0;                                                                   \
        if ((flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE) {                    \
            va_list ap;                                                                 \
            va_start(ap, flags);                                                        \
            m = (mode_t)va_arg(ap, unsigned int);                                       \
            va_end(ap);                                                                 \
        }                                                                               \
        return shim_open(#name, -1000, path, flags, m);                                 \
    }
#define OPENAT_WRAPPER(name)                                                            \
    int name(int dirfd, const char *path, int flags, ...)                               \
    {                                                                                   \
        mode_t m = 0;                                                                   \
        if ((flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE) {                    \
            va_list ap;                                                                 \
            va_start(ap, flags);                                                        \
            m = (mode_t)va_arg(ap, unsigned int);                                       \
            va_end(ap);                                                                 \
        }                                                                               \
        return shim_open(#name, dirfd, path, flags, m);                                 \
    }
OPEN_WRAPPER(open)
OPEN_WRAPPER(open64)
OPENAT_WRAPPER(openat)
OPENAT_WRAPPER(openat64)

/* -- I/O on O_DIRECT descriptors ---------------------------------------------------------- */

static int refuse(int fd)
{
    int fl;
    if (!(mode & M_IO))
        return 0;
    fl = fcntl(fd, F_GETFL);
    if (fl < 0 || !(fl & O_DIRECT))
        return 0;
    hit();
    errno = EINVAL;
    return 1;
}

ssize_t write(int fd, const void *buf, size_t n)
{
    static ssize_t (*real)(int, const void *, size_t);
    if (real == NULL)
        real = dlsym(RTLD_NEXT, "write");
    return refuse(fd) ? -1 : real(fd, buf, n);
}

ssize_t read(int fd, void *buf, size_t n)
{
    static ssize_t (*real)(int, void *, size_t);
    if (real == NULL)
        real = dlsym(RTLD_NEXT, "read");
    return refuse(fd) ? -1 : real(fd, buf, n);
}

ssize_t readv(int fd, const struct iovec *iov, int cnt)
{
    static ssize_t (*real)(int, const struct iovec *, int);
    if (real == NULL)
        real = dlsym(RTLD_NEXT, "readv");
    return refuse(fd) ? -1 : real(fd, iov, cnt);
}

/* -- publishing and cleaning up ------------------------------------------------------------- */

int renameat(int olddirfd, const char *oldpath, int newdirfd, const char *newpath)
{
    static int (*real)(int, const char *, int, const char *);
    char dir[4096], full[8192], hex[160];
    if (real == NULL)
        real = dlsym(RTLD_NEXT, "renameat");
    if (mode & M_PUBLISH) {
        where(olddirfd, dir, sizeof dir);
        snprintf(full, sizeof full, "%s/%s", dir, oldpath);
        note("rename %s %s", full, record_hex(full, -1, hex));
    }
    if ((mode & M_UNTMP) && ends_tmp(oldpath)) {
        hit();
        errno = EIO;
        return -1;
    }
    return real(olddirfd, oldpath, newdirfd, newpath);
}

int linkat(int olddirfd, const char *oldpath, int newdirfd, const char *newpath, int flags)
{
    static int (*real)(int, const char *, int, const char *, int);
    char hex[160];
    if (real == NULL)
        real = dlsym(RTLD_NEXT, "linkat");
    if (mode & M_PUBLISH) {
        int empty = (flags & AT_EMPTY_PATH) && oldpath[0] == '\0';
        note("link %s", record_hex(oldpath, empty ? olddirfd : -1, hex));
    }
    return real(olddirfd, oldpath, newdirfd, newpath, flags);
}

int unlinkat(int dirfd, const char *path, int flags)
{
    static int (*real)(int, const char *, int);
    if (real == NULL)
        real = dlsym(RTLD_NEXT, "unlinkat");
    if ((mode & M_UNTMP) && ends_tmp(path)) {
        hit();
        errno = EBUSY;
        return -1;
    }
    return real(dirfd, path, flags);
}

/* -- raw syscalls the native core makes through libc's syscall() -------------------------- */

long syscall(long number, ...)
{
    static long (*real)(long, ...);
    long a[6];
    va_list ap;
    if (real == NULL)
        real = dlsym(RTLD_NEXT, "syscall");
    va_start(ap, number);
    for (int i = 0; i < 6; i++)
        a[i] = va_arg(ap, long);
    va_end(ap);
#ifdef SYS_io_uring_enter
    if (number == SYS_io_uring_enter && enter_fails()) {
        hit();
        errno = ENOMEM;
        return -1;
    }
#endif
    if ((mode & M_NOAIO) && number == SYS_io_setup) {
        hit();
        errno = ENOSYS;
        return -1;
    }
    if ((mode & M_IO) && number == SYS_io_submit && a[1] >= 1) {
        struct iocb **list = (struct iocb **)a[2];
        if (refuse((int)list[0]->aio_fildes))
            return -1;
    }
    return real(number, a[0], a[1], a[2], a[3], a[4], a[5]);
}
