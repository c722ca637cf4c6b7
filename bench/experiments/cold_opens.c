/* cold_opens.c - open (and close) every path read from stdin on N threads, each taking
 * the next path as it finishes one; prints the wall time in ms. cold_opens.py drops the
 * page cache before each run, so each open walks folders and inodes from the disk: how
 * far a lone job's cold opens gain from doing many at once.
 *   gcc -O2 -pthread -o /tmp/cold_opens bench/experiments/cold_opens.c
 *   /tmp/cold_opens 16 < paths.txt */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_PATHS 65536
#define MAX_THREADS 256

static char *paths[MAX_PATHS];
static int n_paths, next_path;

static void *opener(void *unused)
{
    (void)unused;
    for (;;) {
        int i = __atomic_fetch_add(&next_path, 1, __ATOMIC_RELAXED), fd;
        if (i >= n_paths)
            return NULL;
        fd = open(paths[i], O_RDONLY);
        if (fd < 0) {
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
    struct timespec start, end;
    int n_threads = argc > 1 ? atoi(argv[1]) : 1;

    if (n_threads < 1 || n_threads > MAX_THREADS) {
        fprintf(stderr, "threads: 1..%d, not %s\n", MAX_THREADS, argv[1]);
        return 2;
    }
    while (n_paths < MAX_PATHS && fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\n")] = '\0';
        paths[n_paths++] = strdup(line);
    }
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (int t = 0; t < n_threads; t++)
        pthread_create(&threads[t], NULL, opener, NULL);
    for (int t = 0; t < n_threads; t++)
        pthread_join(threads[t], NULL);
    clock_gettime(CLOCK_MONOTONIC, &end);
    printf("%.3f\n", (end.tv_sec - start.tv_sec) * 1e3 + (end.tv_nsec - start.tv_nsec) / 1e6);
    return 0;
}
