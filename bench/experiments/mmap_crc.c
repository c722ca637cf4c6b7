/* mmap_crc.c - a checksummed load from tmpfs, four ways, thread CPU per GB (medians of
 * interleaved rounds):
 *   read        pread into the slot, no CRC (what vLLM's tier does)
 *   read+crc    pread into the slot, then CRC32C of the slot (the tier's memory-fs path)
 *   map+crc     mmap the file (MAP_POPULATE), copy it to the slot in chunks, CRC32C each
 *               chunk of the mapping right after its copy (it is in cache), munmap
 *   map-nopop   the same without MAP_POPULATE (the copy faults the pages in)
 * The question: does reading the block once (map+crc) beat reading it twice (read+crc)
 * once the mapping's cost is paid?
 *   cd mptier/native && gcc -O2 -I. -o /tmp/mmap_crc ../../bench/experiments/mmap_crc.c \
 *       crc32c.c -lpthread
 *   mkdir -p /dev/shm/x && /tmp/mmap_crc 262144 256 /dev/shm/x 16384 */
#define _GNU_SOURCE
#include "mptier_native.h"
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define ROUNDS 15
#define WAYS 4

static double cpu(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    size_t bb = (size_t)atol(argv[1]), chunk = argc > 4 ? (size_t)atol(argv[4]) : 16384;
    int nfiles = atoi(argv[2]);
    const char *dir = argv[3], *names[WAYS] = {"read", "read+crc", "map+crc", "map-nopop"};
    char *dst = mmap(0, bb * nfiles, PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    char *src = malloc(bb), p[256];
    double r[WAYS][ROUNDS];
    uint32_t sums[WAYS] = {0};

    for (size_t i = 0; i < bb; i++)
        src[i] = (char)(i * 7 + i / 4096);
    for (int f = 0; f < nfiles; f++) {
        snprintf(p, sizeof p, "%s/b%d", dir, f);
        int fd = open(p, O_CREAT | O_WRONLY | O_TRUNC, 0644);
        if (write(fd, src, bb) != (ssize_t)bb)
            return 1;
        close(fd);
    }
    for (int round = 0; round < ROUNDS; round++)
        for (int w0 = 0; w0 < WAYS; w0++) {
            int w = (w0 + round) % WAYS; /* rotate the order */
            double c0 = cpu();
            uint32_t acc = 0;
            for (int f = 0; f < nfiles; f++) {
                char *d = dst + (size_t)f * bb;
                uint32_t crc = 0;
                snprintf(p, sizeof p, "%s/b%d", dir, f);
                int fd = open(p, O_RDONLY);
                if (w <= 1) {
                    if (pread(fd, d, bb, 0) != (ssize_t)bb)
                        return 2;
                    if (w == 1)
                        crc = mpt_crc32c(0, d, bb, MPT_CRC32C_BEST);
                } else {
                    char *m = mmap(0, bb, PROT_READ, MAP_SHARED | (w == 2 ? MAP_POPULATE : 0),
                                   fd, 0);
                    if (m == MAP_FAILED)
                        return 3;
                    for (size_t o = 0; o < bb; o += chunk) {
                        size_t part = bb - o < chunk ? bb - o : chunk;
                        memcpy(d + o, m + o, part);
                        crc = mpt_crc32c(crc, m + o, part, MPT_CRC32C_BEST);
                    }
                    munmap(m, bb);
                }
                close(fd);
                acc += crc; /* the same files: every way must print the same sum */
            }
            sums[w] = acc;
            r[w][round] = (cpu() - c0) / (bb * (double)nfiles / 1e9);
        }
    for (int w = 0; w < WAYS; w++) {
        qsort(r[w], ROUNDS, sizeof(double), cmp);
        printf("block %7zu chunk %6zu %-10s cpu median %.3f s/GB (q1 %.3f q3 %.3f) crc %08x\n",
               bb, chunk, names[w], r[w][ROUNDS / 2], r[w][ROUNDS / 4], r[w][3 * ROUNDS / 4],
               sums[w]);
    }
    for (int f = 0; f < nfiles; f++) {
        snprintf(p, sizeof p, "%s/b%d", dir, f);
        unlink(p);
    }
    return 0;
}
