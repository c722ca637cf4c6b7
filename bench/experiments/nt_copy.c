/* nt_copy.c - thread CPU per GB of a bounced load's last step, the copy of a checked block
 * from the bounce buffer into its slot: memcpy against the native core's own
 * mpt_copy_to_slot (block.c: streaming stores, which write the slot's cache lines without
 * reading them first and leave them out of the caches). Source cold (as after DMA) then
 * CRC32C-checked (so hot, the load's order); destination a 256 MiB shared mapping walked
 * in order (cold, as the engine's slots). 9 interleaved rounds, medians
 * (docs/performance.md, section 16).
 *   cd mptier/native && gcc -O2 -I. -o /tmp/nt_copy ../../bench/experiments/nt_copy.c *.c -lpthread
 *   /tmp/nt_copy 2097152 */
#define _GNU_SOURCE
#include "mptier_native.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double cpu(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    size_t bb = argc > 1 ? (size_t)atol(argv[1]) : 2u << 20, nb = (256u << 20) / bb;
    char *src = mmap(0, 64 << 20, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    char *dst = mmap(0, 256 << 20, PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    char *evict = malloc(64 << 20);
    double r[2][9];
    uint32_t acc = 0;
    for (size_t i = 0; i < (64u << 20); i++)
        src[i] = (char)(i * 13);
    for (int round = 0; round < 9; round++)
        for (int m = 0; m < 2; m++) {
            double t = 0;
            memset(evict, round, 64 << 20); /* the slots' lines out of the caches */
            for (size_t b = 0; b < nb; b++) {
                char *s = src + (b % ((64u << 20) / bb)) * bb, *d = dst + b * bb;
                double c0;
                if (b % 8 == 0)
                    memset(evict, (int)b, 64 << 20); /* cold source, as after DMA */
                c0 = cpu();
                acc ^= mpt_crc32c(0, s, bb, MPT_CRC32C_BEST);
                if (m == 0)
                    memcpy(d, s, bb);
                else
                    mpt_copy_to_slot(d, s, bb);
                t += cpu() - c0;
            }
            r[m][round] = t / (nb * bb / 1e9);
        }
    for (int m = 0; m < 2; m++) {
        double v[9];
        memcpy(v, r[m], sizeof v);
        for (int i = 0; i < 9; i++)
            for (int k = i + 1; k < 9; k++)
                if (v[k] < v[i]) {
                    double x = v[i];
                    v[i] = v[k];
                    v[k] = x;
                }
        printf("block %zu  crc then %-16s median %.3f s/GB  (q1 %.3f q3 %.3f)\n", bb,
               m ? "streaming copy" : "memcpy", v[4], v[2], v[6]);
    }
    return acc == 12345;
}
