/* cold_opens.c - open (and close) every path read from stdin on N threads, each taking
 * the next path as it finishes one; prints the wall time in ms. cold_opens.py drops the
 * page cache before each run, so each open walks folders and inodes from the disk: how
 * far a lone job's cold opens gain from doing many at once. With a second argument, each
 * thread also reads that many bytes of every file it opens (O_DIRECT, into a buffer of
 * its own) before closing it: the fastest a lone job's opens and reads go together on
 * this machine, at each number of threads.
 *   gcc -O2 -pthread -o /tmp/cold_opens bench/experiments/cold_opens.c
 *   /tmp/cold_opens 16 < paths.txt          (opens only)
 *   /tmp/cold_opens 16 262144 < paths.txt   (opens and 256 KiB reads) */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define MAX_PATHS 65536
#define MAX_THREADS 256
#define DIRECT_ALIGN 4096 /* O_DIRECT wants the buffer, offset and length so aligned */
/* Each thread reads into huge pages, as the tier's bounce buffer does: a direct read into
 * 4 KiB pages takes one segment per page, and this disk splits such requests. */
#define HUGE_PAGE (2L << 20)

static char *paths[MAX_PATHS];
static int n_paths, next_path;
static long read_bytes;

/* A buffer of huge pages for one thread's reads, mapped before the clock starts. */
static char *read_buffer(void)
{
    char *buffer;
    long buffer_bytes = (read_bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;

    if (posix_memalign((void **)&buffer, HUGE_PAGE, buffer_bytes)) {
        fprintf(stderr, "no memory for a %ld-byte buffer\n", buffer_bytes);
        exit(1);
    }
    madvise(buffer, buffer_bytes, MADV_HUGEPAGE);
    memset(buffer, 0, buffer_bytes);
    return buffer;
}

static void *opener(void *buffer)
{
    for (;;) {
        int i = __atomic_fetch_add(&next_path, 1, __ATOMIC_RELAXED), fd;
        if (i >= n_paths)
            return NULL;
        fd = open(paths[i], read_bytes ? O_RDONLY | O_DIRECT : O_RDONLY);
        if (fd < 0) {
            perror(paths[i]);
            exit(1);
        }
        if (read_bytes && pread(fd, buffer, read_bytes, 0) != read_bytes) {
            perror(paths[i]);
            exit(1);
        }
        close(fd);
    }
}

int main(int argc, char **argv)
{
    char line[4096];
    pthread_t threads[MAX_THREADS];
    char *buffers[MAX_THREADS] = {NULL};
    struct timespec start, end;
    int n_threads = argc > 1 ? atoi(argv[1]) : 1;

    if (n_threads < 1 || n_threads > MAX_THREADS) {
        fprintf(stderr, "threads: 1..%d, not %s\n", MAX_THREADS, argv[1]);
        return 2;
    }
    read_bytes = argc > 2 ? atol(argv[2]) : 0;
    if (read_bytes < 0 || read_bytes % DIRECT_ALIGN) {
        fprintf(stderr, "bytes to read: a multiple of %d, not %s\n", DIRECT_ALIGN, argv[2]);
        return 2;
    }
    while (n_paths < MAX_PATHS && fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\n")] = '\0';
        paths[n_paths++] = strdup(line);
    }
    for (int t = 0; read_bytes && t < n_threads; t++)
        buffers[t] = read_buffer();
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (int t = 0; t < n_threads; t++)
        pthread_create(&threads[t], NULL, opener, buffers[t]);
    for (int t = 0; t < n_threads; t++)
        pthread_join(threads[t], NULL);
    clock_gettime(CLOCK_MONOTONIC, &end);
    printf("%.3f\n", (end.tv_sec - start.tv_sec) * 1e3 + (end.tv_nsec - start.tv_nsec) / 1e6);
    return 0;
}
