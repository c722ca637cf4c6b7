/*
 * crc32c.c - CRC32C (Castagnoli), the checksum of vLLM's block record.
 *
 * Reflected polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF; check value
 * crc32c("123456789") == 0xE3069283. Three implementations, chosen once at run time:
 *
 *   x86-64   SSE4.2 "crc32" instruction   \  three independent streams over a chunk,
 *   aarch64  ARMv8 CRC32C instructions    /  joined with a table-driven shift operator
 *   any      slicing-by-8 tables (portable, also forced with MPT_CRC32C_TABLE)
 *
 * Why three streams: the crc32 instruction has a latency of about three cycles and a
 * throughput of one per cycle, so a single dependency chain uses a third of the unit.
 * Streams A, B, C of a chunk A|B|C start from (crc, 0, 0) and join by linearity:
 *
 *   raw(A|B|C, r) = Z_{|B|+|C|}(raw(A, r)) ^ Z_{|C|}(raw(B, 0)) ^ raw(C, 0)
 *
 * where raw() is the CRC register without the final xor and Z_n is "feed n zero
 * bytes", a linear map on 32 bits: a 32x32 matrix over GF(2), applied here through four
 * 256-entry tables (one per byte of the register). The tables are built at first use.
 *
 * The hardware functions carry target attributes, so the file builds without -msse4.2
 * and runs everywhere; the CPU check decides whether they are ever called.
 */

#include "mptier_native.h"

#include <pthread.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define MPT_CRC_HW "sse4.2"
#define MPT_HW_TARGET __attribute__((target("sse4.2")))
#define MPT_HW_CRC64(c, v) ((uint32_t)_mm_crc32_u64((c), (v)))
#define MPT_HW_CRC8(c, v) _mm_crc32_u8((c), (v))
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#include <arm_acle.h>
#include <sys/auxv.h>
#ifndef HWCAP_CRC32
#define HWCAP_CRC32 (1 << 7) /* arch/arm64/include/uapi/asm/hwcap.h */
#endif
#define MPT_CRC_HW "armv8-crc"
#ifdef __clang__
#define MPT_HW_TARGET __attribute__((target("crc")))
#else
#define MPT_HW_TARGET __attribute__((target("+crc")))
#endif
#define MPT_HW_CRC64(c, v) __crc32cd((c), (v))
#define MPT_HW_CRC8(c, v) __crc32cb((c), (v))
#endif

#define MPT_CRC_POLY 0x82F63B78u /* Castagnoli, bit-reflected */
/* Stream lengths of the hardware path. A long chunk (3 x 8 KiB) keeps the joins rare
 * (one per 24 KiB); the short one takes most of what is left before a single stream
 * finishes the tail, whose throughput is a third. Both are multiples of 8. */
#define MPT_CRC_LONG 8192
#define MPT_CRC_SHORT 256

static uint32_t mpt_slice[8][256];     /* slicing-by-8 tables; [0] is the byte table */
static uint32_t mpt_zeros_long[2][4][256];  /* Z_LONG, Z_2LONG as per-byte tables */
static uint32_t mpt_zeros_short[2][4][256]; /* Z_SHORT, Z_2SHORT */
static int mpt_have_hw;
static pthread_once_t mpt_crc_once = PTHREAD_ONCE_INIT;

/* -- GF(2) operators: mat[i] is the image of bit i ------------------------------------ */

static uint32_t gf2_apply(const uint32_t mat[32], uint32_t vec)
{
    uint32_t sum = 0;
    for (int i = 0; vec != 0; i++, vec >>= 1)
        if (vec & 1)
            sum ^= mat[i];
    return sum;
}

/* out = a after b (apply b first). out may not alias a or b. */
static void gf2_compose(uint32_t out[32], const uint32_t a[32], const uint32_t b[32])
{
    for (int i = 0; i < 32; i++)
        out[i] = gf2_apply(a, b[i]);
}

/* Z_n: the register after n zero bytes, as a matrix. */
static void gf2_zeros(uint32_t out[32], size_t n)
{
    uint32_t base[32], tmp[32];
    int i;

    /* one zero bit: reg' = (reg >> 1) ^ (reg & 1 ? POLY : 0) */
    base[0] = MPT_CRC_POLY;
    for (i = 1; i < 32; i++)
        base[i] = 1u << (i - 1);
    for (i = 0; i < 3; i++) { /* 1 bit -> 8 bits */
        gf2_compose(tmp, base, base);
        memcpy(base, tmp, sizeof tmp);
    }
    for (i = 0; i < 32; i++) /* identity */
        out[i] = 1u << i;
    while (n != 0) {
        if (n & 1) {
            gf2_compose(tmp, base, out);
            memcpy(out, tmp, sizeof tmp);
        }
        n >>= 1;
        if (n != 0) {
            gf2_compose(tmp, base, base);
            memcpy(base, tmp, sizeof tmp);
        }
    }
}

static void gf2_tables(uint32_t tab[4][256], size_t n)
{
    uint32_t mat[32];
    gf2_zeros(mat, n);
    for (int k = 0; k < 4; k++)
        for (uint32_t b = 0; b < 256; b++)
            tab[k][b] = gf2_apply(mat, b << (8 * k));
}

static inline uint32_t mpt_shift(const uint32_t tab[4][256], uint32_t crc)
{
    return tab[0][crc & 0xff] ^ tab[1][(crc >> 8) & 0xff] ^ tab[2][(crc >> 16) & 0xff] ^
           tab[3][crc >> 24];
}

/* -- the portable path ------------------------------------------------------------------ */

static uint32_t mpt_crc_table(uint32_t crc, const unsigned char *p, size_t n)
{
    while (n != 0 && ((uintptr_t)p & 7) != 0) {
        crc = mpt_slice[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
        n--;
    }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc;
        crc = mpt_slice[7][w & 0xff] ^ mpt_slice[6][(w >> 8) & 0xff] ^
              mpt_slice[5][(w >> 16) & 0xff] ^ mpt_slice[4][(w >> 24) & 0xff] ^
              mpt_slice[3][(w >> 32) & 0xff] ^ mpt_slice[2][(w >> 40) & 0xff] ^
              mpt_slice[1][(w >> 48) & 0xff] ^ mpt_slice[0][w >> 56];
        p += 8;
        n -= 8;
    }
#endif
    while (n-- != 0)
        crc = mpt_slice[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return crc;
}

/* -- the hardware path ------------------------------------------------------------------- */

#ifdef MPT_CRC_HW
static inline uint64_t mpt_load64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8); /* one unaligned load; the instruction takes little-endian words */
    return v;
}

MPT_HW_TARGET static uint32_t mpt_crc_streams(uint32_t crc, const unsigned char *p,
                                              size_t n, size_t len,
                                              const uint32_t zeros[2][4][256],
                                              const unsigned char **end)
{
    while (n >= 3 * len) {
        const unsigned char *stop = p + len;
        uint32_t c0 = crc, c1 = 0, c2 = 0;
        do {
            c0 = MPT_HW_CRC64(c0, mpt_load64(p));
            c1 = MPT_HW_CRC64(c1, mpt_load64(p + len));
            c2 = MPT_HW_CRC64(c2, mpt_load64(p + 2 * len));
            p += 8;
        } while (p < stop);
        crc = mpt_shift(zeros[1], c0) ^ mpt_shift(zeros[0], c1) ^ c2;
        p += 2 * len;
        n -= 3 * len;
    }
    *end = p;
    return crc;
}

MPT_HW_TARGET static uint32_t mpt_crc_hw(uint32_t crc, const unsigned char *p, size_t n)
{
    const unsigned char *q;

    while (n != 0 && ((uintptr_t)p & 7) != 0) {
        crc = MPT_HW_CRC8(crc, *p++);
        n--;
    }
    crc = mpt_crc_streams(crc, p, n, MPT_CRC_LONG, mpt_zeros_long, &q);
    n -= (size_t)(q - p);
    p = q;
    crc = mpt_crc_streams(crc, p, n, MPT_CRC_SHORT, mpt_zeros_short, &q);
    n -= (size_t)(q - p);
    p = q;
    while (n >= 8) {
        crc = MPT_HW_CRC64(crc, mpt_load64(p));
        p += 8;
        n -= 8;
    }
    while (n-- != 0)
        crc = MPT_HW_CRC8(crc, *p++);
    return crc;
}

static int mpt_cpu_has_crc(void)
{
#if defined(__x86_64__)
    return __builtin_cpu_supports("sse4.2");
#else
    return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0;
#endif
}
#endif /* MPT_CRC_HW */

static void mpt_crc_init(void)
{
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (MPT_CRC_POLY & (0u - (c & 1)));
        mpt_slice[0][b] = c;
    }
    for (int t = 1; t < 8; t++)
        for (int b = 0; b < 256; b++) {
            uint32_t prev = mpt_slice[t - 1][b];
            mpt_slice[t][b] = mpt_slice[0][prev & 0xff] ^ (prev >> 8);
        }
    gf2_tables(mpt_zeros_long[0], MPT_CRC_LONG);
    gf2_tables(mpt_zeros_long[1], 2 * MPT_CRC_LONG);
    gf2_tables(mpt_zeros_short[0], MPT_CRC_SHORT);
    gf2_tables(mpt_zeros_short[1], 2 * MPT_CRC_SHORT);
#ifdef MPT_CRC_HW
    mpt_have_hw = mpt_cpu_has_crc();
#endif
}

uint32_t mpt_crc32c(uint32_t crc, const char *p, size_t n, int impl)
{
    const unsigned char *u = (const unsigned char *)p;

    pthread_once(&mpt_crc_once, mpt_crc_init);
    crc = ~crc;
#ifdef MPT_CRC_HW
    if (mpt_have_hw && impl != MPT_CRC32C_TABLE)
        return ~mpt_crc_hw(crc, u, n);
#endif
    (void)impl;
    return ~mpt_crc_table(crc, u, n);
}

const char *mpt_crc32c_impl(void)
{
    pthread_once(&mpt_crc_once, mpt_crc_init);
#ifdef MPT_CRC_HW
    if (mpt_have_hw)
        return MPT_CRC_HW;
#endif
    return "table";
}
