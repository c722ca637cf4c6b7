/*
 * budget.c - per-block cost of mptier's store and load steps, and an io_uring variant.
 *
 *   cc -O2 -o /tmp/budget bench/experiments/budget.c
 *   /tmp/budget MODE ROOT BLOCK_BYTES N [direct] [batch] [fixed_buf]
 *
 * MODE:
 *   store, load              the C core's system-call sequence (mptier_io.c), each step
 *                            timed with CLOCK_MONOTONIC: exists check (access), temporary
 *                            name, open (creating folders on ENOENT), write, close, rename;
 *                            load: open, read, close. Prints median and mean µs per step.
 *   store-uring, load-uring  the same blocks through io_uring, BATCH blocks per submit
 *                            (default 16): per block a linked chain mkdir, mkdir (hard
 *                            links: an existing folder does not break the chain), openat
 *                            into a registered file slot, write/read, close, rename --
 *                            one io_uring_enter per batch. No exists check. fixed_buf=1
 *                            registers the buffer once (READ_FIXED / WRITE_FIXED).
 *
 * Files go into the tier's layout, <root>/<h[0:3]>/<h[3:5]>_g0/<h>.bin, h = 64 hex
 * digits derived from the block number, so a fresh folder needs new sub-folders as
 * the tier's do. The buffer holds min(N, 256) blocks; block i uses slot i % 256.
 * The store variants skip nothing: run them on a fresh ROOT (the caller removes it).
 */
#define _GNU_SOURCE 1
#include <errno.h>
#include <fcntl.h>
#include <linux/io_uring.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define SLOTS 256
enum { S_EXISTS, S_NAME, S_OPEN, S_MKDIR, S_IO, S_CLOSE, S_RENAME, S_TOTAL, S_N };
static const char *step_names[S_N] = {"exists check", "temp name", "open", "mkdir (on ENOENT)",
                                      "write/read", "close", "rename", "total"};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void block_path(char *out, size_t size, const char *root, size_t i, char *dir1,
                       char *dir2)
{
    char h[65];
    uint64_t x = i * 0x9E3779B97F4A7C15ull + 12345;
    for (int k = 0; k < 4; k++) {
        x ^= x >> 33;
        x *= 0xff51afd7ed558ccdull;
        x ^= x >> 29;
        snprintf(h + 16 * k, 17, "%016llx", (unsigned long long)x);
    }
    snprintf(dir1, 4096, "%s/%.3s", root, h);
    snprintf(dir2, 4096, "%s/%.3s/%.2s_g0", root, h, h + 3);
    snprintf(out, size, "%s/%.3s/%.2s_g0/%s.bin", root, h, h + 3, h);
}

/* -- the system-call loop, timed step by step ------------------------------------------ */

static int mkdirs(const char *d1, const char *d2)
{
    if (mkdir(d2, 0777) == 0 || errno == EEXIST)
        return 0;
    if (errno != ENOENT)
        return -errno;
    if (mkdir(d1, 0777) != 0 && errno != EEXIST)
        return -errno;
    return mkdir(d2, 0777) == 0 || errno == EEXIST ? 0 : -errno;
}

static int run_loop(int store, const char *root, size_t bs, size_t n, int direct, char *buf,
                    uint64_t (*t)[S_N])
{
    char path[4096], tmp[4200], d1[4096], d2[4096];
    static unsigned long counter;
    for (size_t i = 0; i < n; i++) {
        char *p = buf + (i % SLOTS) * bs;
        uint64_t a, b, start = now_ns();
        block_path(path, sizeof path, root, i, d1, d2);
        int fd;
        if (store) {
            a = now_ns();
            if (access(path, F_OK) == 0)
                continue;
            b = now_ns(); t[i][S_EXISTS] = b - a;
            snprintf(tmp, sizeof tmp, "%s.%ld.%ld.%lu.tmp", path, (long)getpid(),
                     (long)syscall(SYS_gettid), counter++);
            a = now_ns(); t[i][S_NAME] = a - b;
            fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | (direct ? O_DIRECT : 0),
                      0644);
            b = now_ns(); t[i][S_OPEN] = b - a;
            if (fd < 0 && errno == ENOENT) {
                if (mkdirs(d1, d2) != 0)
                    return -errno;
                a = now_ns(); t[i][S_MKDIR] = a - b;
                snprintf(tmp, sizeof tmp, "%s.%ld.%ld.%lu.tmp", path, (long)getpid(),
                         (long)syscall(SYS_gettid), counter++);
                fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC |
                          (direct ? O_DIRECT : 0), 0644);
                b = now_ns(); t[i][S_OPEN] += b - a;
            }
            if (fd < 0)
                return -errno;
            if (write(fd, p, bs) != (ssize_t)bs)
                return -EIO;
            a = now_ns(); t[i][S_IO] = a - b;
            close(fd);
            b = now_ns(); t[i][S_CLOSE] = b - a;
            if (rename(tmp, path) != 0)
                return -errno;
            a = now_ns(); t[i][S_RENAME] = a - b;
        } else {
            a = now_ns();
            fd = open(path, O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
            if (fd < 0)
                return -errno;
            b = now_ns(); t[i][S_OPEN] = b - a;
            if (read(fd, p, bs) != (ssize_t)bs)
                return -EIO;
            a = now_ns(); t[i][S_IO] = a - b;
            close(fd);
            b = now_ns(); t[i][S_CLOSE] = b - a;
            a = b;
        }
        t[i][S_TOTAL] = a - start;
    }
    return 0;
}

/* -- io_uring, by raw system calls ------------------------------------------------------ */

struct ring {
    int fd;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    unsigned entries;
};

static int ring_init(struct ring *r, unsigned entries, unsigned n_files)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    r->fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (r->fd < 0)
        return -errno;
    r->entries = p.sq_entries;
    size_t sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    size_t cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    char *sq = mmap(0, sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                    IORING_OFF_SQ_RING);
    char *cq = (p.features & IORING_FEAT_SINGLE_MMAP) ? sq :
        mmap(0, cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
             IORING_OFF_CQ_RING);
    if (p.features & IORING_FEAT_SINGLE_MMAP && cq_len > sq_len) {
        munmap(sq, sq_len);
        sq = cq = mmap(0, cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                       IORING_OFF_SQ_RING);
    }
    r->sqes = mmap(0, p.sq_entries * sizeof(struct io_uring_sqe), PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
    if (sq == MAP_FAILED || cq == MAP_FAILED || r->sqes == MAP_FAILED)
        return -ENOMEM;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    /* a sparse table of n_files registered file slots: openat puts its file there */
    struct io_uring_rsrc_register reg;
    memset(&reg, 0, sizeof reg);
    reg.nr = n_files;
    reg.flags = IORING_RSRC_REGISTER_SPARSE;
    if (syscall(__NR_io_uring_register, r->fd, IORING_REGISTER_FILES2, &reg, sizeof reg) < 0)
        return -errno;
    return 0;
}

static struct io_uring_sqe *sqe_get(struct ring *r, unsigned *pending)
{
    unsigned tail = *r->sq_tail + *pending;
    unsigned idx = tail & *r->sq_mask;
    struct io_uring_sqe *s = &r->sqes[idx];
    memset(s, 0, sizeof *s);
    r->sq_array[idx] = idx;
    (*pending)++;
    return s;
}

static int ring_submit_wait(struct ring *r, unsigned pending, int *results, unsigned n_res)
{
    __atomic_store_n(r->sq_tail, *r->sq_tail + pending, __ATOMIC_RELEASE);
    int rc = (int)syscall(__NR_io_uring_enter, r->fd, pending, pending,
                          IORING_ENTER_GETEVENTS, NULL, 0);
    if (rc < 0)
        return -errno;
    unsigned seen = 0;
    while (seen < pending) {
        unsigned head = *r->cq_head, tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
        if (head == tail) {
            if (syscall(__NR_io_uring_enter, r->fd, 0, 1, IORING_ENTER_GETEVENTS, NULL, 0) < 0)
                return -errno;
            continue;
        }
        for (; head != tail; head++, seen++) {
            struct io_uring_cqe *c = &r->cqes[head & *r->cq_mask];
            if (c->user_data < n_res)
                results[c->user_data] = c->res;
        }
        __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    }
    return 0;
}

#define OPS_PER_STORE 6
#define OPS_PER_LOAD 3

static int run_uring(int store, const char *root, size_t bs, size_t n, int direct, char *buf,
                     unsigned batch, int fixed_buf, uint64_t *batch_ns)
{
    struct ring r;
    memset(&r, 0, sizeof r);
    unsigned per = store ? OPS_PER_STORE : OPS_PER_LOAD;
    int rc = ring_init(&r, batch * per < 8 ? 8 : batch * per, batch);
    if (rc)
        return rc;
    if (fixed_buf) {  /* register the whole buffer once: no page pinning per request */
        struct iovec iov = {buf, (n < SLOTS ? n : SLOTS) * bs};
        if (syscall(__NR_io_uring_register, r.fd, IORING_REGISTER_BUFFERS, &iov, 1) < 0)
            return -errno;
    }
    char (*paths)[4096] = malloc(batch * sizeof *paths);
    char (*tmps)[4200] = malloc(batch * sizeof *tmps);
    char (*d1)[4096] = malloc(batch * sizeof *d1);
    char (*d2)[4096] = malloc(batch * sizeof *d2);
    int *res = malloc(batch * per * sizeof(int));
    unsigned long counter = 0;
    for (size_t first = 0; first < n; first += batch) {
        unsigned m = (unsigned)(n - first < batch ? n - first : batch), pending = 0;
        uint64_t start = now_ns();
        for (unsigned k = 0; k < m; k++) {
            size_t i = first + k;
            char *p = buf + (i % SLOTS) * bs;
            block_path(paths[k], 4096, root, i, d1[k], d2[k]);
            struct io_uring_sqe *s;
            if (store) {
                snprintf(tmps[k], 4200, "%s.%ld.%ld.%lu.tmp", paths[k], (long)getpid(),
                         (long)getpid(), counter++);
                s = sqe_get(&r, &pending);  /* mkdir <h[0:3]>, EEXIST is fine */
                s->opcode = IORING_OP_MKDIRAT; s->fd = AT_FDCWD; s->addr = (uintptr_t)d1[k];
                s->len = 0777; s->flags = IOSQE_IO_HARDLINK; s->user_data = k * per + 0;
                s = sqe_get(&r, &pending);  /* mkdir <h[3:5]>_g0 */
                s->opcode = IORING_OP_MKDIRAT; s->fd = AT_FDCWD; s->addr = (uintptr_t)d2[k];
                s->len = 0777; s->flags = IOSQE_IO_HARDLINK; s->user_data = k * per + 1;
                s = sqe_get(&r, &pending);  /* open the temporary file into slot k */
                s->opcode = IORING_OP_OPENAT; s->fd = AT_FDCWD; s->addr = (uintptr_t)tmps[k];
                s->open_flags = O_WRONLY | O_CREAT | O_EXCL | (direct ? O_DIRECT : 0);
                s->len = 0644; s->file_index = k + 1; s->flags = IOSQE_IO_LINK;
                s->user_data = k * per + 2;
                s = sqe_get(&r, &pending);
                s->opcode = fixed_buf ? IORING_OP_WRITE_FIXED : IORING_OP_WRITE;
                s->fd = (int)k; s->addr = (uintptr_t)p;
                s->len = (unsigned)bs; s->off = 0; s->flags = IOSQE_FIXED_FILE | IOSQE_IO_LINK;
                s->user_data = k * per + 3;
                s = sqe_get(&r, &pending);
                s->opcode = IORING_OP_CLOSE; s->file_index = k + 1; s->flags = IOSQE_IO_LINK;
                s->user_data = k * per + 4;
                s = sqe_get(&r, &pending);
                s->opcode = IORING_OP_RENAMEAT; s->fd = AT_FDCWD; s->addr = (uintptr_t)tmps[k];
                s->len = (unsigned)AT_FDCWD; s->addr2 = (uintptr_t)paths[k];
                s->user_data = k * per + 5;
            } else {
                s = sqe_get(&r, &pending);
                s->opcode = IORING_OP_OPENAT; s->fd = AT_FDCWD; s->addr = (uintptr_t)paths[k];
                s->open_flags = O_RDONLY | (direct ? O_DIRECT : 0); s->file_index = k + 1;
                s->flags = IOSQE_IO_LINK; s->user_data = k * per + 0;
                s = sqe_get(&r, &pending);
                s->opcode = fixed_buf ? IORING_OP_READ_FIXED : IORING_OP_READ;
                s->fd = (int)k; s->addr = (uintptr_t)p;
                s->len = (unsigned)bs; s->off = 0; s->flags = IOSQE_FIXED_FILE | IOSQE_IO_LINK;
                s->user_data = k * per + 1;
                s = sqe_get(&r, &pending);
                s->opcode = IORING_OP_CLOSE; s->file_index = k + 1;
                s->user_data = k * per + 2;
            }
        }
        rc = ring_submit_wait(&r, pending, res, batch * per);
        if (rc)
            return rc;
        for (unsigned k = 0; k < m; k++) {
            int io = res[k * per + (store ? 3 : 1)];
            int last = res[k * per + per - 1];
            if (io != (int)bs || last < 0) {
                fprintf(stderr, "block %zu: io %d last %d (%s)\n", first + k, io, last,
                        strerror(-(io < 0 ? io : last)));
                return -EIO;
            }
        }
        batch_ns[first / batch] = now_ns() - start;
    }
    close(r.fd);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 5) {
        fprintf(stderr, "usage: %s store|load|store-uring|load-uring ROOT BLOCK N [direct] "
                        "[batch]\n", argv[0]);
        return 2;
    }
    const char *mode = argv[1], *root = argv[2];
    size_t bs = strtoull(argv[3], 0, 10), n = strtoull(argv[4], 0, 10);
    int direct = argc > 5 && atoi(argv[5]);
    unsigned batch = argc > 6 ? (unsigned)atoi(argv[6]) : 16;
    int fixed_buf = argc > 7 && atoi(argv[7]);
    int store = strncmp(mode, "store", 5) == 0, uring = strstr(mode, "uring") != NULL;
    size_t slots = n < SLOTS ? n : SLOTS;
    char *buf = mmap(0, slots * bs, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    memset(buf, 0x5a, slots * bs);
    uint64_t t0 = now_ns();
    int rc;
    if (uring) {
        size_t nb = (n + batch - 1) / batch;
        uint64_t *bt = calloc(nb, sizeof *bt);
        rc = run_uring(store, root, bs, n, direct, buf, batch, fixed_buf, bt);
        uint64_t wall = now_ns() - t0;
        if (rc) {
            fprintf(stderr, "%s failed: %s\n", mode, strerror(-rc));
            return 1;
        }
        qsort(bt, nb, sizeof *bt, cmp_u64);
        printf("{\"mode\": \"%s\", \"gbps\": %.3f, \"us_per_block\": %.2f, "
               "\"batch_p50_us_per_block\": %.2f}\n", mode, n * bs / (double)wall,
               wall / 1e3 / n, bt[nb / 2] / 1e3 / batch);
        return 0;
    }
    uint64_t (*t)[S_N] = calloc(n, sizeof *t);
    rc = run_loop(store, root, bs, n, direct, buf, t);
    uint64_t wall = now_ns() - t0;
    if (rc) {
        fprintf(stderr, "%s failed: %s\n", mode, strerror(-rc));
        return 1;
    }
    printf("{\"mode\": \"%s\", \"gbps\": %.3f, \"us_per_block\": %.2f, \"steps\": {", mode,
           n * bs / (double)wall, wall / 1e3 / n);
    uint64_t *col = malloc(n * sizeof *col);
    int first = 1;
    for (int s = 0; s < S_N; s++) {
        double sum = 0;
        for (size_t i = 0; i < n; i++)
            sum += (double)(col[i] = t[i][s]);
        if (sum == 0)
            continue;
        qsort(col, n, sizeof *col, cmp_u64);
        printf("%s\"%s\": [%.2f, %.2f]", first ? "" : ", ", step_names[s], col[n / 2] / 1e3,
               sum / n / 1e3);
        first = 0;
    }
    printf("}}\n");
    return 0;
}
