/* fresh_files.c - store one block into each path read from stdin on N threads, each
 * taking the next path as it finishes one, the way vLLM + C stores a block: make its
 * missing folders, write a temporary file beside it (O_DIRECT, from huge pages), close,
 * rename it into place; prints the wall time in ms. fresh_fill.py runs it on fresh roots
 * beside the tier and vLLM + C: the fastest this file system takes fresh blocks, at each
 * number of threads, without a tier.
 *   gcc -O2 -pthread -o /tmp/fresh_files bench/experiments/fresh_files.c
 *   /tmp/fresh_files 16 262144 /var/tmp/root/blocks < relative-paths.txt */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MAX_PATHS 1048576
#define MAX_THREADS 256
#define HUGE_PAGE (2L << 20) /* the source in huge pages: a direct write's segments */

static char *paths[MAX_PATHS];
static int n_paths, next_path, root;
static long block_bytes;
static char *source;

static void fail(const char *what, const char *path)
{
    fprintf(stderr, "%s %s: %s\n", what, path, strerror(errno));
    exit(1);
}

/* mkdir every folder of rel below root that is not there yet (rel's own name excluded). */
static void make_parents(const char *rel)
{
    char dir[4096];
    for (const char *slash = strchr(rel, '/'); slash; slash = strchr(slash + 1, '/')) {
        size_t len = (size_t)(slash - rel);
        memcpy(dir, rel, len);
        dir[len] = '\0';
        if (mkdirat(root, dir, 0755) != 0 && errno != EEXIST)
            fail("mkdir", dir);
    }
}

static void *storer(void *unused)
{
    char tmp[4200];
    (void)unused;
    for (;;) {
        int i = __atomic_fetch_add(&next_path, 1, __ATOMIC_RELAXED), fd;
        if (i >= n_paths)
            return NULL;
        make_parents(paths[i]);
        snprintf(tmp, sizeof tmp, "%s.tmp%d", paths[i], i);
        fd = openat(root, tmp, O_CREAT | O_EXCL | O_WRONLY | O_DIRECT, 0644);
        if (fd < 0)
            fail("open", tmp);
        if (write(fd, source, block_bytes) != block_bytes)
            fail("write", tmp);
        if (close(fd) != 0)
            fail("close", tmp);
        if (renameat(root, tmp, root, paths[i]) != 0)
            fail("rename", tmp);
    }
}

int main(int argc, char **argv)
{
    char line[4096];
    pthread_t threads[MAX_THREADS];
    struct timespec start, end;
    int n_threads = argc > 3 ? atoi(argv[1]) : 0;
    long source_bytes;

    if (n_threads < 1 || n_threads > MAX_THREADS) {
        fprintf(stderr, "usage: fresh_files THREADS(1..%d) BLOCK_BYTES ROOT < paths\n",
                MAX_THREADS);
        return 2;
    }
    block_bytes = atol(argv[2]);
    if (block_bytes <= 0 || block_bytes % 4096) {
        fprintf(stderr, "block bytes: a multiple of 4096, not %s\n", argv[2]);
        return 2;
    }
    root = open(argv[3], O_PATH | O_DIRECTORY);
    if (root < 0)
        fail("open", argv[3]);
    source_bytes = (block_bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    if (posix_memalign((void **)&source, HUGE_PAGE, source_bytes))
        fail("allocate", "source");
    madvise(source, source_bytes, MADV_HUGEPAGE);
    memset(source, 7, source_bytes);
    while (n_paths < MAX_PATHS && fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\n")] = '\0';
        paths[n_paths++] = strdup(line);
    }
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (int t = 0; t < n_threads; t++)
        pthread_create(&threads[t], NULL, storer, NULL);
    for (int t = 0; t < n_threads; t++)
        pthread_join(threads[t], NULL);
    clock_gettime(CLOCK_MONOTONIC, &end);
    printf("%.3f\n", (end.tv_sec - start.tv_sec) * 1e3 + (end.tv_nsec - start.tv_nsec) / 1e6);
    return 0;
}
