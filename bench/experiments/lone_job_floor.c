/* lone_job_floor.c - the fastest this machine loads one lone job out of tmpfs, by the
 * number of threads that share it: the floor under the "64-block job alone" target
 * (issue 17: a lone job's load at most 0.5x vLLM + C's time, which reads a job's blocks
 * one after another on one thread).
 *
 * Before each timed read the job's files are written anew, untimed (unlinked, created,
 * written), as a store leaves them before the bench's lone load; "again" as the fifth
 * argument reads the same files over and over instead (their pages already active).
 *
 * Ways, each the wall time of one whole job (open + pread into the job's slots + close,
 * every block), on T threads of a pool started before the clock (no thread is created
 * inside a measurement; thread t pinned to the t-th CPU unless "unpinned" is the sixth
 * argument), T = 1..4:
 *   read     pread into the slot                (vLLM + C's load, at T = 1)
 *   read+crc pread, then CRC32C of the slot      (mptier's memory-fs load)
 *   memcpy   a copy of the job's bytes from a buffer already in memory into the slots,
 *            no file at all: what the memory lets T threads move
 * Block i goes to thread i % T. The ways and thread counts run in a rotated order each
 * round; the printed figures are medians over the rounds, each way's median over the
 * median of read at T = 1 (the anchor's way), and for T = 2 how many jobs had both
 * threads begin on one CPU (their shares then ran one after the other). If two threads
 * cannot bring a job to half of one thread's time even without a CRC and without any
 * file, the target is the machine's, not the tier's.
 *
 *   cd mptier/native && gcc -O2 -I. -o /tmp/lone_job_floor \
 *       ../../bench/experiments/lone_job_floor.c crc32c.c -lpthread
 *   mkdir -p /dev/shm/lj && /tmp/lone_job_floor 2097152 64 /dev/shm/lj 31
 *   /tmp/lone_job_floor 262144 64 /dev/shm/lj 31; rm -r /dev/shm/lj
 *
 * docs/performance.md, section 30. */
#define _GNU_SOURCE
#include "mptier_native.h"
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define MAX_THREADS 4
#define MAX_ROUNDS 101
#define WAYS 3 /* read, read+crc, memcpy */

static const char *way_names[WAYS] = {"read", "read+crc", "memcpy"};

static struct {
    size_t block_bytes;
    int nblocks, threads, way;
    const char *dir;
    char *slots, *source;
    uint32_t sums[MAX_THREADS];
    int start_cpu[MAX_THREADS]; /* where each thread began its share of the last job */
    int failed;
    pthread_barrier_t start, done;
} job;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void block_path(char *p, size_t n, int i)
{
    snprintf(p, n, "%s/b%d", job.dir, i);
}

static void run_share(int me)
{
    uint32_t acc = 0;
    job.start_cpu[me] = sched_getcpu();
    for (int i = me; i < job.nblocks; i += job.threads) {
        char *slot = job.slots + (size_t)i * job.block_bytes, p[512];
        if (job.way == 2) {
            memcpy(slot, job.source + (size_t)i * job.block_bytes, job.block_bytes);
            continue;
        }
        block_path(p, sizeof p, i);
        int fd = open(p, O_RDONLY);
        if (fd < 0 || pread(fd, slot, job.block_bytes, 0) != (ssize_t)job.block_bytes)
            job.failed = 1;
        if (fd >= 0)
            close(fd);
        if (job.way == 1)
            acc += mpt_crc32c(0, slot, job.block_bytes, MPT_CRC32C_BEST);
    }
    job.sums[me] = acc;
}

static void *pool_thread(void *arg)
{
    int me = (int)(long)arg;
    for (;;) {
        pthread_barrier_wait(&job.start);
        if (job.threads == 0)
            return NULL;
        if (me < job.threads)
            run_share(me);
        pthread_barrier_wait(&job.done);
    }
}

/* The job's files written anew, as a store leaves them right before the bench's lone
 * load: the first read of fresh pages costs more than reading the same files again
 * (docs/performance.md, section 30). */
static int write_blocks(void)
{
    for (int i = 0; i < job.nblocks; i++) {
        char p[512];
        block_path(p, sizeof p, i);
        unlink(p);
        int fd = open(p, O_CREAT | O_WRONLY | O_TRUNC, 0644);
        if (fd < 0)
            return -1;
        ssize_t wrote = write(fd, job.source + (size_t)i * job.block_bytes, job.block_bytes);
        close(fd);
        if (wrote != (ssize_t)job.block_bytes)
            return -1;
    }
    return 0;
}

/* Jobs on two threads whose threads both began on one CPU: the scheduler placed the
 * second where the first ran, and the two shares ran one after the other. */
static int stacked[WAYS];
static int fresh = 1; /* 0: the same files read again each time (argv[5] = "again") */
static int unpinned;  /* argv[6] = "unpinned": the scheduler places the threads */

/* One job on `threads` threads by `way`; the pool's idle members pass both barriers. */
static double timed_job(int threads, int way)
{
    job.threads = threads;
    job.way = way;
    if (fresh && way != 2 && write_blocks() != 0)
        job.failed = 1;
    double t0 = now();
    pthread_barrier_wait(&job.start);
    pthread_barrier_wait(&job.done);
    double seconds = now() - t0;
    if (threads == 2 && job.start_cpu[0] == job.start_cpu[1])
        stacked[way]++;
    return seconds;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: %s BLOCK_BYTES NBLOCKS DIR [ROUNDS [fresh|again [pinned|unpinned]]]\n",
                argv[0]);
        return 64;
    }
    job.block_bytes = (size_t)atol(argv[1]);
    job.nblocks = atoi(argv[2]);
    job.dir = argv[3];
    int rounds = argc > 4 ? atoi(argv[4]) : 31;
    if (argc > 5 && strcmp(argv[5], "fresh") != 0 && strcmp(argv[5], "again") != 0) {
        fprintf(stderr, "files %s: say fresh (written anew before each job) or again\n",
                argv[5]);
        return 64;
    }
    if (argc > 6 && strcmp(argv[6], "pinned") != 0 && strcmp(argv[6], "unpinned") != 0) {
        fprintf(stderr, "threads %s: say pinned (one to a CPU) or unpinned\n", argv[6]);
        return 64;
    }
    fresh = !(argc > 5 && strcmp(argv[5], "again") == 0);
    unpinned = argc > 6 && strcmp(argv[6], "unpinned") == 0;
    if (rounds < 1 || rounds > MAX_ROUNDS || job.nblocks < 1) {
        fprintf(stderr, "ROUNDS must be 1-%d and NBLOCKS at least 1\n", MAX_ROUNDS);
        return 64;
    }
    size_t total = job.block_bytes * job.nblocks;
    job.slots = mmap(0, total, PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    job.source = mmap(0, total, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (job.slots == MAP_FAILED || job.source == MAP_FAILED)
        return 1;
    for (size_t i = 0; i < total; i++)
        job.source[i] = (char)(i * 7 + i / 4096);
    if (write_blocks() != 0)
        return 2;
    pthread_t pool[MAX_THREADS];
    pthread_barrier_init(&job.start, NULL, MAX_THREADS + 1);
    pthread_barrier_init(&job.done, NULL, MAX_THREADS + 1);
    /* Thread t runs on the t-th CPU this process may use (modulo their number): the floor
     * is the best placement, and left to itself the scheduler sometimes started both
     * threads of a job on one CPU, whose shares then ran one after the other. */
    cpu_set_t allowed;
    int cpus[CPU_SETSIZE], ncpus = 0;
    sched_getaffinity(0, sizeof allowed, &allowed);
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &allowed))
            cpus[ncpus++] = c;
    for (long t = 0; t < MAX_THREADS; t++) {
        pthread_create(&pool[t], NULL, pool_thread, (void *)t);
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpus[t % ncpus], &one);
        if (!unpinned)
            pthread_setaffinity_np(pool[t], sizeof one, &one);
    }

    static double ms[WAYS][MAX_THREADS][MAX_ROUNDS];
    int cases = WAYS * MAX_THREADS;
    for (int c = 0; c < cases; c++) /* a first pass, untimed: every path warm */
        timed_job(c % MAX_THREADS + 1, c / MAX_THREADS);
    memset(stacked, 0, sizeof stacked); /* the untimed pass does not count */
    for (int round = 0; round < rounds; round++)
        for (int c0 = 0; c0 < cases; c0++) {
            int c = (c0 + round) % cases; /* rotate the order */
            int threads = c % MAX_THREADS + 1, way = c / MAX_THREADS;
            ms[way][threads - 1][round] = timed_job(threads, way) * 1e3;
        }
    job.threads = 0; /* the pool's signal to leave */
    pthread_barrier_wait(&job.start);
    for (int t = 0; t < MAX_THREADS; t++)
        pthread_join(pool[t], NULL);

    double anchor;
    qsort(ms[0][0], rounds, sizeof(double), cmp);
    anchor = ms[0][0][rounds / 2];
    printf("block %zu x %d (%.0f MiB), %s files, threads %s, %d rounds, CRC32C path %s; "
           "medians, ms (q1-q3) and over read at 1 thread\n", job.block_bytes, job.nblocks,
           total / 1048576.0, fresh ? "fresh" : "re-read", unpinned ? "unpinned" : "pinned",
           rounds, mpt_crc32c_selected());
    for (int w = 0; w < WAYS; w++)
        for (int t = 0; t < MAX_THREADS; t++) {
            double *r = ms[w][t];
            qsort(r, rounds, sizeof(double), cmp);
            printf("  %-8s threads %d  %7.2f ms (%.2f-%.2f)  %.2fx  %.2f GB/s\n",
                   way_names[w], t + 1, r[rounds / 2], r[rounds / 4], r[3 * rounds / 4],
                   r[rounds / 2] / anchor, total / r[rounds / 2] / 1e6);
        }
    for (int w = 0; w < WAYS; w++)
        printf("  %-8s on 2 threads: both began on one CPU in %d of %d jobs\n", way_names[w],
               stacked[w], rounds);
    for (int i = 0; i < job.nblocks; i++) {
        char p[512];
        block_path(p, sizeof p, i);
        unlink(p);
    }
    if (job.failed)
        fprintf(stderr, "a read failed: the figures above are not a job's\n");
    return job.failed ? 3 : 0;
}
