/* store_copy_crc.c - a bounced store's copy and checksum: each block of a 1 GiB source
 * (out of cache, as the engine's buffer is) copied into a slot of a 16 MiB huge-page
 * buffer and checksummed there, two ways interleaved per round: the whole block copied,
 * then its CRC32C (the core before 2026-12-06 15:10), and mpt_crc32c_copy, piece by
 * piece (the CRC reads each piece while the copy left it in cache). Prints GB/s of each
 * way, one line per round.
 *   cd mptier/native && gcc -O2 -I. -o /tmp/store_copy_crc \
 *       ../../bench/experiments/store_copy_crc.c crc32c.c -lpthread
 *   /tmp/store_copy_crc 2097152 6 */
#define _GNU_SOURCE
#include "mptier_native.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define SOURCE_BYTES (1UL << 30)
#define BOUNCE_BYTES (16UL << 20)

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s BLOCK_BYTES ROUNDS\n", argv[0]);
        return 2;
    }
    size_t len = strtoul(argv[1], NULL, 0), slots = BOUNCE_BYTES / len;
    int rounds = atoi(argv[2]);
    char *src = mmap(NULL, SOURCE_BYTES, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char *bounce = mmap(NULL, BOUNCE_BYTES, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (src == MAP_FAILED || bounce == MAP_FAILED || len == 0 || slots == 0) {
        fprintf(stderr, "cannot map the buffers (block of %zu bytes)\n", len);
        return 1;
    }
    madvise(bounce, BOUNCE_BYTES, MADV_HUGEPAGE);
    memset(bounce, 0, BOUNCE_BYTES);
    for (size_t i = 0; i < SOURCE_BYTES; i += 64)
        src[i] = (char)(i * 13);
    volatile uint32_t sink = 0;
    for (int r = 0; r < rounds; r++) {
        double rate[2];
        for (int way = 0; way < 2; way++) {
            double t0 = now();
            for (size_t k = 0; k < SOURCE_BYTES / len; k++) {
                char *s = src + k * len, *d = bounce + (k % slots) * len;
                if (way == 0) {
                    memcpy(d, s, len);
                    sink ^= mpt_crc32c(0, d, len, MPT_CRC32C_BEST);
                } else {
                    sink ^= mpt_crc32c_copy(0, d, s, len);
                }
            }
            rate[way] = SOURCE_BYTES / (now() - t0) / 1e9;
        }
        printf("copy then crc %.2f GB/s  copy with crc %.2f GB/s  ratio %.2f\n",
               rate[0], rate[1], rate[1] / rate[0]);
    }
    return sink == 1; /* keeps the CRCs */
}
