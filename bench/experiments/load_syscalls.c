/* load_syscalls.c - what each system call of the core's load of one block costs
 * (mpt_load_one in mptier/native/block.c), against the three a bare tier makes (open,
 * read, close): 2,000 files of one block in 50 folders, each call timed by the monotonic
 * clock, two rounds, medians and 90th percentiles. The files are in the page cache (a
 * tmpfs root, or a disk root just written): the calls' own cost, not the device's.
 *   gcc -O2 -o /tmp/load_syscalls bench/experiments/load_syscalls.c
 *   mkdir /dev/shm/ls && /tmp/load_syscalls /dev/shm/ls 262144; rm -r /dev/shm/ls */
#define _GNU_SOURCE
#include <fcntl.h>
#include <linux/openat2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

#define FILES 2000
#define FOLDERS 50
#define ROUNDS 2
enum { OPENAT2, OPENAT, FSTAT, FCNTL, XATTR, READ, TOUCH, CLOSE, CALLS };
static const char *names[CALLS] = {
    "openat2 (RESOLVE_BENEATH, the core's open)", "openat (a bare tier's open)",
    "fstat (a regular file of the block's size?)", "fcntl (O_NONBLOCK off again)",
    "fgetxattr (the checksum record)", "read (the block)", "futimens (atime: the LRU)",
    "close"};
static double when[CALLS][FILES * ROUNDS];

static double now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static int by_value(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s EMPTY_FOLDER BLOCK_BYTES\n", argv[0]);
        return 2;
    }
    size_t block = strtoul(argv[2], NULL, 10);
    int root = open(argv[1], O_RDONLY | O_DIRECTORY);
    char *buf = aligned_alloc(4096, block);
    char rel[64];
    if (root < 0 || !buf) {
        perror(argv[1]);
        return 1;
    }
    memset(buf, 7, block);
    for (int i = 0; i < FILES; i++) {
        snprintf(rel, sizeof rel, "f%02d", i % FOLDERS);
        mkdirat(root, rel, 0755);
        snprintf(rel, sizeof rel, "f%02d/b%04d.bin", i % FOLDERS, i);
        int fd = openat(root, rel, O_CREAT | O_WRONLY | O_TRUNC, 0644);
        if (fd < 0 || write(fd, buf, block) != (ssize_t)block ||
            fsetxattr(fd, "user.crc", "abcd", 4, 0) != 0) {
            perror(rel);
            return 1;
        }
        close(fd);
    }
    for (int n = 0; n < FILES * ROUNDS; n++) {
        int i = n % FILES;
        struct open_how how = {
            .flags = O_RDONLY | O_NONBLOCK | O_NOCTTY | O_NOFOLLOW,
            .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS};
        struct timespec times[2] = {{0, UTIME_NOW}, {0, UTIME_OMIT}};
        struct stat st;
        char value[16];
        double t0, t1;
        int fd;

        snprintf(rel, sizeof rel, "f%02d/b%04d.bin", i % FOLDERS, i);
        t0 = now_ns();
        fd = (int)syscall(SYS_openat2, root, rel, &how, sizeof how);
        t1 = now_ns();
        when[OPENAT2][n] = t1 - t0;
        close(fd);
        t0 = now_ns();
        fd = openat(root, rel, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_NOFOLLOW);
        t1 = now_ns();
        when[OPENAT][n] = t1 - t0;
#define TIMED(call, expr) do { t0 = now_ns(); (void)(expr); when[call][n] = now_ns() - t0; } while (0)
        TIMED(FSTAT, fstat(fd, &st));
        TIMED(FCNTL, fcntl(fd, F_SETFL, 0));
        TIMED(XATTR, fgetxattr(fd, "user.crc", value, sizeof value));
        TIMED(READ, read(fd, buf, block));
        TIMED(TOUCH, futimens(fd, times));
        TIMED(CLOSE, close(fd));
    }
    printf("%s, %zu-byte blocks, %d files x %d rounds: us per call, median / p90\n",
           argv[1], block, FILES, ROUNDS);
    for (int c = 0; c < CALLS; c++) {
        qsort(when[c], FILES * ROUNDS, sizeof(double), by_value);
        printf("  %-44s %7.2f / %7.2f\n", names[c], when[c][FILES * ROUNDS / 2] / 1e3,
               when[c][FILES * ROUNDS * 9 / 10] / 1e3);
    }
    for (int i = 0; i < FILES; i++) {
        snprintf(rel, sizeof rel, "f%02d/b%04d.bin", i % FOLDERS, i);
        unlinkat(root, rel, 0);
    }
    for (int f = 0; f < FOLDERS; f++) {
        snprintf(rel, sizeof rel, "f%02d", f);
        unlinkat(root, rel, AT_REMOVEDIR);
    }
    return 0;
}
