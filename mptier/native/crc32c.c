/*
 * crc32c.c - CRC32C (Castagnoli), the checksum of vLLM's block record.
 *
 * Reflected polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF; check value
 * crc32c("123456789") == 0xE3069283. Six implementations ("paths"), each a fallback for
 * the ones above it; the fastest the CPU runs is chosen once, at first use (cpuid and
 * xgetbv / getauxval), and mpt_crc32c_select() may name another for this process:
 *
 *   avx512-vpclmulqdq  x86-64   carry-less multiply folding, 4 x 512-bit registers
 *   avx2-vpclmulqdq    x86-64   folding on 8 x 256-bit registers beside four crc32
 *                               streams (Zen 3+, Ice Lake+)
 *   pclmulqdq          x86-64   folding on 8 x 128-bit registers beside four crc32
 *                               streams (any CPU with PCLMULQDQ and SSE4.2)
 *   sse4.2             x86-64   the "crc32" instruction   \  three independent streams,
 *   armv8-crc          aarch64  the CRC32C instructions    /  joined by a shift operator
 *   table              any      slicing-by-8 tables (portable)
 *
 * The folding paths reduce their last 16 bytes with the crc32 instruction and leave
 * what is too short for them (the last 0..15 bytes; below a 16 KiB chunk for
 * pclmulqdq, below 256 bytes for avx2-vpclmulqdq) to the sse4.2 path.
 *
 * Why three streams: the crc32 instruction has a latency of about three cycles and a
 * throughput of one per cycle, so a single dependency chain uses a third of the unit.
 * Streams A, B, C of a chunk A|B|C start from (crc, 0, 0) and join by linearity:
 *
 *   raw(A|B|C, r) = Z_{|B|+|C|}(raw(A, r)) ^ Z_{|C|}(raw(B, 0)) ^ raw(C, 0)
 *
 * where raw() is the CRC register without the final xor and Z_n is "feed n zero
 * bytes", a linear map on 32 bits: a 32x32 matrix over GF(2), applied here through four
 * 256-entry tables (one per byte of the register). Why folding on top: even three
 * streams make 8 bytes a cycle (17 to 23 GB/s on a Zen 3 EPYC), about a memory copy's
 * speed, so checksums would cost a sixth to a quarter of a copy-bound (tmpfs) store or
 * load. Carry-less products of wide registers go faster, and run on another unit than
 * crc32, so the two together go faster still (see "folding beside the crc32
 * instruction"). The tables and constants are built at first use, from the polynomial.
 *
 * The SIMD functions carry target attributes, so the file builds with plain flags (no
 * -msse4.2, -mavx2 or -mavx512f) and runs everywhere; the CPU check decides whether they
 * are ever called. The check includes xgetbv: a CPU may have AVX2 or AVX-512 while the
 * kernel does not save the wide registers (XCR0), and then they must not be used.
 */

#include "mptier_native.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define MPT_CRC_HW "sse4.2"
#define MPT_CRC_FOLD 1 /* the carry-less multiply paths are compiled in */
#define MPT_HW_TARGET __attribute__((target("sse4.2")))
#define MPT_CLMUL_TARGET __attribute__((target("pclmul,sse4.2")))
#define MPT_AVX2_TARGET __attribute__((target("avx2,vpclmulqdq,pclmul,sse4.2")))
#define MPT_AVX512_TARGET __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))
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
/* Shortest input each folding path takes: what its registers load in the first round.
 * Below, its setup and final folds cost more than they save (the sse4.2 path runs). */
#define MPT_AVX512_MIN 512
#define MPT_AVX2_MIN 256

static uint32_t mpt_slice[8][256];     /* slicing-by-8 tables; [0] is the byte table */
static uint32_t mpt_zeros_long[2][4][256];  /* Z_LONG, Z_2LONG as per-byte tables */
static uint32_t mpt_zeros_short[2][4][256]; /* Z_SHORT, Z_2SHORT */
static int mpt_have_hw, mpt_have_pclmul, mpt_have_avx2, mpt_have_avx512;
/* What MPT_CRC32C_BEST runs: the fastest path, or the one mpt_crc32c_select() named.
 * Read and written atomically: a select may race with CRCs on other threads. */
static int mpt_crc_best;
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
#endif /* MPT_CRC_HW */

#ifdef MPT_CRC_FOLD
/* -- the folding paths: carry-less multiplication --------------------------------------------
 *
 * The message is a polynomial over GF(2); for a reflected CRC the first bit of the first
 * byte (its low bit) is the highest power. With a zero initial register, the CRC of an
 * N-bit message M is M(x) * x^32 mod P, so it depends only on M mod P and leading zero
 * bytes change nothing. A nonzero initial register r is the same as r XORed into the
 * message's first four bytes (reflected: the register's low byte meets the first byte).
 *
 * Folding. A 128-bit lane L loaded little-endian holds message bit t (t = 0 the first)
 * at integer bit t, so as a polynomial, counting from the lane's end,
 *
 *   L(x) = lo(x) * x^64 + hi(x)        lo = the first 8 bytes, hi = the next 8
 *
 * Moving L on by D bits (the lane D bits further into the message has D more bits
 * after it) multiplies it by x^D, and modulo P
 *
 *   L * x^D == lo * (x^(D+64) mod P) + hi * (x^D mod P)
 *
 * Each term is a 64-bit by 32-bit carry-less product (PCLMULQDQ) of degree < 96, so it
 * fits in the lane standing D bits on, into which it is XORed. All lanes fold onto later
 * ones this way until one lane is left; its CRC, started from zero, is the message's
 * (everything before it being congruent to zero). The crc32 instruction computes that
 * directly: two crc32_u64 over the lane's two halves are exactly "L * x^32 mod P",
 * which replaces the usual Barrett reduction with two constants.
 *
 * The one-bit shift. PCLMULQDQ multiplies integers: bit i is x^i. Our operands are
 * reflected (bit t of a 64-bit half is x^(63-t)), and the product of two reflected
 * 64-bit values, read back as a reflected 128-bit lane (bit t is x^(127-t)), is the true
 * product times x: 63 + 63 = 126, one short of 127. So the constants are one power
 * lower: K_lo = x^(D+63) mod P and K_hi = x^(D-1) mod P, each a 32-bit remainder placed
 * so that its x^j coefficient sits at bit 63 - j of a 64-bit operand (the register
 * value, whose bit j is x^(31-j), shifted left by 32). mpt_xpow_mod() computes
 * x^n mod P by n - 31 shift-and-reduce steps from x^31, and mpt_fold_init() the pairs
 * for every fold distance used here; tests/test_crc32c.py derives the same constants
 * in pure Python with carry-less arithmetic and checks the scheme end to end.
 *
 * Each path keeps R lanes in flight (eight registers: the products' latency, about four
 * cycles, is hidden behind the other seven registers' work), moves every register on
 * by one round of R lanes at a time, then folds the registers onto the last in a tree
 * (half onto half), the lanes within the last register onto its last lane, and what is
 * left of the input 16 bytes at a time. The last 0..15 bytes go to the sse4.2 path.
 */

static uint64_t mpt_fold_k[17][2]; /* [d / 16]: fold constants (K_lo, K_hi) for d bytes */

/* x^n mod P as a register value (bit j is the coefficient of x^(31 - j)); n >= 31. */
static uint32_t mpt_xpow_mod(unsigned n)
{
    uint32_t reg = 1; /* x^31 */
    for (unsigned k = 31; k < n; k++)
        reg = (reg >> 1) ^ (MPT_CRC_POLY & (0u - (reg & 1)));
    return reg;
}

static void mpt_fold_init(void)
{
    /* 16..64 and 128: the tree folds and tails; 128 and 256: the round of the 128-bit
     * path and of the wide ones; 192: the AVX-512 path's first register onto its last. */
    static const unsigned distances[] = {16, 32, 48, 64, 128, 192, 256};
    for (size_t i = 0; i < sizeof distances / sizeof distances[0]; i++) {
        unsigned bits = 8 * distances[i];
        mpt_fold_k[distances[i] / 16][0] = (uint64_t)mpt_xpow_mod(bits + 63) << 32;
        mpt_fold_k[distances[i] / 16][1] = (uint64_t)mpt_xpow_mod(bits - 1) << 32;
    }
}

/* The 128-bit pieces, shared by all three paths (their targets include this one's). */
MPT_CLMUL_TARGET static inline __m128i mpt_k128(unsigned bytes)
{
    const uint64_t *k = mpt_fold_k[bytes / 16];
    return _mm_set_epi64x((long long)k[1], (long long)k[0]);
}

/* Lane a moved on by k's distance, XOR data. */
MPT_CLMUL_TARGET static inline __m128i mpt_fold128(__m128i a, __m128i k, __m128i data)
{
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(a, k, 0x00),
                                       _mm_clmulepi64_si128(a, k, 0x11)), data);
}

static inline __m128i mpt_loadu128(const unsigned char *p)
{
    return _mm_loadu_si128((const __m128i *)p);
}

/* A lane's CRC from a zero register: "L * x^32 mod P" by two crc32 instructions. */
MPT_CLMUL_TARGET static inline uint32_t mpt_lane_crc(__m128i a)
{
    uint32_t crc = (uint32_t)_mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(a));
    return (uint32_t)_mm_crc32_u64(crc, (uint64_t)_mm_extract_epi64(a, 1));
}

/* The end of every folding path: the rest 16 bytes at a time onto lane a, the lane's
 * CRC, then the last 0..15 bytes by the crc32 instruction. */
MPT_CLMUL_TARGET static uint32_t mpt_fold_finish(__m128i a, const unsigned char *p, size_t n)
{
    __m128i k = mpt_k128(16);

    for (; n >= 16; p += 16, n -= 16)
        a = mpt_fold128(a, k, mpt_loadu128(p));
    return mpt_crc_hw(mpt_lane_crc(a), p, n);
}

/* Eight consecutive 16-byte lanes folded onto the last, in a tree: 0..3 onto 4..7 (64
 * bytes on), 4, 5 onto 6, 7 (32), 6 onto 7 (16); then its CRC. */
MPT_CLMUL_TARGET static inline uint32_t mpt_reduce128(__m128i x0, __m128i x1, __m128i x2,
                                                      __m128i x3, __m128i x4, __m128i x5,
                                                      __m128i x6, __m128i x7)
{
    __m128i k = mpt_k128(64);
    x4 = mpt_fold128(x0, k, x4);
    x5 = mpt_fold128(x1, k, x5);
    x6 = mpt_fold128(x2, k, x6);
    x7 = mpt_fold128(x3, k, x7);
    k = mpt_k128(32);
    x6 = mpt_fold128(x4, k, x6);
    x7 = mpt_fold128(x5, k, x7);
    return mpt_lane_crc(mpt_fold128(x6, mpt_k128(16), x7));
}

/* VPCLMULQDQ on 256-bit registers (AVX2 machines): 8 registers of two lanes, 256 bytes a
 * round; one instruction multiplies both lanes. */
MPT_AVX2_TARGET static inline __m256i mpt_k256(unsigned bytes)
{
    return _mm256_broadcastsi128_si256(mpt_k128(bytes));
}

MPT_AVX2_TARGET static inline __m256i mpt_fold256(__m256i a, __m256i k, __m256i data)
{
    return _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128(a, k, 0x00),
                                             _mm256_clmulepi64_epi128(a, k, 0x11)), data);
}

MPT_AVX2_TARGET static inline __m256i mpt_loadu256(const unsigned char *p)
{
    return _mm256_loadu_si256((const __m256i *)p);
}

/* Eight consecutive 32-byte registers folded onto the last, the same tree at twice the
 * distances. */
MPT_AVX2_TARGET static inline __m256i mpt_tree256(__m256i x0, __m256i x1, __m256i x2,
                                                  __m256i x3, __m256i x4, __m256i x5,
                                                  __m256i x6, __m256i x7)
{
    __m256i k = mpt_k256(128);
    x4 = mpt_fold256(x0, k, x4);
    x5 = mpt_fold256(x1, k, x5);
    x6 = mpt_fold256(x2, k, x6);
    x7 = mpt_fold256(x3, k, x7);
    k = mpt_k256(64);
    x6 = mpt_fold256(x4, k, x6);
    x7 = mpt_fold256(x5, k, x7);
    return mpt_fold256(x6, mpt_k256(32), x7);
}

/* A register's low lane onto its high one (16 bytes on). */
MPT_AVX2_TARGET static inline __m128i mpt_lanes256(__m256i x)
{
    return mpt_fold128(_mm256_castsi256_si128(x), mpt_k128(16), _mm256_extracti128_si256(x, 1));
}

MPT_AVX2_TARGET static inline uint32_t mpt_reduce256(__m256i x0, __m256i x1, __m256i x2,
                                                     __m256i x3, __m256i x4, __m256i x5,
                                                     __m256i x6, __m256i x7)
{
    return mpt_lane_crc(mpt_lanes256(mpt_tree256(x0, x1, x2, x3, x4, x5, x6, x7)));
}

/* 256-bit folding alone (inputs and tails shorter than a hybrid chunk). n >= MPT_AVX2_MIN. */
MPT_AVX2_TARGET static uint32_t mpt_crc_avx2(uint32_t crc, const unsigned char *p, size_t n)
{
    __m256i x0 = mpt_loadu256(p), x1 = mpt_loadu256(p + 32);
    __m256i x2 = mpt_loadu256(p + 64), x3 = mpt_loadu256(p + 96);
    __m256i x4 = mpt_loadu256(p + 128), x5 = mpt_loadu256(p + 160);
    __m256i x6 = mpt_loadu256(p + 192), x7 = mpt_loadu256(p + 224);
    __m256i k = mpt_k256(256);

    x0 = _mm256_xor_si256(x0, _mm256_zextsi128_si256(_mm_cvtsi32_si128((int)crc)));
    for (p += 256, n -= 256; n >= 256; p += 256, n -= 256) {
        x0 = mpt_fold256(x0, k, mpt_loadu256(p));
        x1 = mpt_fold256(x1, k, mpt_loadu256(p + 32));
        x2 = mpt_fold256(x2, k, mpt_loadu256(p + 64));
        x3 = mpt_fold256(x3, k, mpt_loadu256(p + 96));
        x4 = mpt_fold256(x4, k, mpt_loadu256(p + 128));
        x5 = mpt_fold256(x5, k, mpt_loadu256(p + 160));
        x6 = mpt_fold256(x6, k, mpt_loadu256(p + 192));
        x7 = mpt_fold256(x7, k, mpt_loadu256(p + 224));
    }
    x7 = mpt_tree256(x0, x1, x2, x3, x4, x5, x6, x7);
    for (k = mpt_k256(32); n >= 32; p += 32, n -= 32) /* less than a round left */
        x7 = mpt_fold256(x7, k, mpt_loadu256(p));
    return mpt_fold_finish(mpt_lanes256(x7), p, n);
}

/* VPCLMULQDQ on 512-bit registers: 4 registers of four lanes, 256 bytes a round.
 * n >= MPT_AVX512_MIN. */
MPT_AVX512_TARGET static inline __m512i mpt_k512(unsigned bytes)
{
    return _mm512_broadcast_i32x4(mpt_k128(bytes));
}

/* Each 128-bit lane of a, moved on by k's distance, XOR data (one three-way XOR). */
MPT_AVX512_TARGET static inline __m512i mpt_fold512(__m512i a, __m512i k, __m512i data)
{
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a, k, 0x00),
                                     _mm512_clmulepi64_epi128(a, k, 0x11), data, 0x96);
}

MPT_AVX512_TARGET static uint32_t mpt_crc_avx512(uint32_t crc, const unsigned char *p,
                                                 size_t n)
{
    __m512i x0 = _mm512_loadu_si512(p), x1 = _mm512_loadu_si512(p + 64);
    __m512i x2 = _mm512_loadu_si512(p + 128), x3 = _mm512_loadu_si512(p + 192);
    __m512i k = mpt_k512(256);
    __m128i a;

    x0 = _mm512_xor_si512(x0, _mm512_set_epi64(0, 0, 0, 0, 0, 0, 0, (long long)crc));
    for (p += 256, n -= 256; n >= 256; p += 256, n -= 256) {
        x0 = mpt_fold512(x0, k, _mm512_loadu_si512(p));
        x1 = mpt_fold512(x1, k, _mm512_loadu_si512(p + 64));
        x2 = mpt_fold512(x2, k, _mm512_loadu_si512(p + 128));
        x3 = mpt_fold512(x3, k, _mm512_loadu_si512(p + 192));
    }
    x3 = mpt_fold512(x0, mpt_k512(192), x3); /* the four registers onto the last */
    x3 = mpt_fold512(x1, mpt_k512(128), x3);
    x3 = mpt_fold512(x2, mpt_k512(64), x3);
    a = _mm512_extracti32x4_epi32(x3, 3); /* its four lanes onto the last */
    a = mpt_fold128(_mm512_extracti32x4_epi32(x3, 0), mpt_k128(48), a);
    a = mpt_fold128(_mm512_extracti32x4_epi32(x3, 1), mpt_k128(32), a);
    a = mpt_fold128(_mm512_extracti32x4_epi32(x3, 2), mpt_k128(16), a);
    return mpt_fold_finish(a, p, n);
}
/* -- folding beside the crc32 instruction ---------------------------------------------------
 *
 * Why: the carry-less multiplier and the crc32 instruction are separate units. On the
 * Zen 3 EPYC this was written on, (V)PCLMULQDQ issues once per two cycles whatever the
 * register width, so folding alone does 8 bytes a cycle on 256-bit registers and 4 on
 * 128-bit ones, and crc32 (one a cycle, 8 bytes each) 8; running both over different
 * parts of the input at once adds the two. A chunk of MPT_HYB_CHUNK bytes is split
 *
 *   F (folded) | S0 | S1 | S2 | S3 (four crc32 streams of equal length Ls)
 *
 * and one loop advances all five by one round at a time, one register's products
 * alternating with one word of each stream, so the out-of-order core overlaps them.
 * Each part starts from a zero register, and by linearity
 *
 *   raw(chunk, r) = Z_CHUNK(r) ^ Z_4Ls(raw(F)) ^ Z_3Ls(raw(S0)) ^ Z_2Ls(raw(S1))
 *                   ^ Z_Ls(raw(S2)) ^ raw(S3)
 *
 * so no part waits for another (the running CRC meets the chunk only at its join). The
 * split is chosen so that both units finish a round together on Zen 3: 256-bit folding
 * takes 8 KiB (32 rounds of 256 bytes, 16 products each) beside 4 x 2 KiB of streams (8
 * crc32 per stream a round); 128-bit folding 4 KiB beside 4 x 3 KiB. Four streams, not
 * three, because 16 KiB then splits evenly; four chains of a 3-cycle instruction still
 * keep the unit busy. A 16 KiB chunk divides the usual block sizes (powers of two from
 * 16 KiB up), so a block is all chunks; a last partial chunk runs 256-bit folding
 * alone (avx2) or the sse4.2 path (pclmulqdq: 128-bit folding alone is slower).
 *
 * Z_D by a multiplication instead of tables: for a register value c (bit j = x^(31-j)),
 * c(x) * x^D mod P is one PCLMULQDQ and one crc32. Place c in the high half of a 64-bit
 * operand (as a reflected 64-bit value it is then the polynomial c(x)) and K = x^(D-33)
 * mod P likewise; their product, read as a reflected 128-bit lane, is x * c * K
 * (the one-bit shift above), of degree < 64, so it lies entirely in the high 64 bits.
 * crc32_u64(0, w) of those 8 bytes is w(x) * x^32 mod P = c * K * x^33 = c * x^D mod P.
 */

#define MPT_HYB_CHUNK 16384 /* bytes a chunk (a power of two: block sizes divide by it) */
#define MPT_HYB_ROUNDS 32   /* rounds a chunk: the fold part is 32 x its round */
#define MPT_HYB_STREAMS 4

/* The layout of a chunk for one register width, and its join constants. */
struct mpt_hybrid {
    size_t fold_bytes;   /* F: rounds x the fold round (8 registers of 16 or 32 bytes) */
    size_t stream_bytes; /* Ls: (CHUNK - F) / 4 */
    uint64_t k_chunk, k_fold, k_s0, k_s1, k_s2; /* K for Z_CHUNK, Z_4Ls .. Z_Ls */
};

#define MPT_AVX2_FOLD (MPT_HYB_ROUNDS * 256)
#define MPT_PCLMUL_FOLD (MPT_HYB_ROUNDS * 128)
static struct mpt_hybrid mpt_hyb_avx2 = {
    MPT_AVX2_FOLD, (MPT_HYB_CHUNK - MPT_AVX2_FOLD) / MPT_HYB_STREAMS, 0, 0, 0, 0, 0};
static struct mpt_hybrid mpt_hyb_pclmul = {
    MPT_PCLMUL_FOLD, (MPT_HYB_CHUNK - MPT_PCLMUL_FOLD) / MPT_HYB_STREAMS, 0, 0, 0, 0, 0};

/* K for Z_D of D bytes: x^(8D - 33) mod P in the high half of a 64-bit operand. */
static uint64_t mpt_shift_k(size_t bytes)
{
    return (uint64_t)mpt_xpow_mod((unsigned)(8 * bytes - 33)) << 32;
}

static void mpt_hybrid_init(struct mpt_hybrid *h)
{
    h->k_chunk = mpt_shift_k(MPT_HYB_CHUNK);
    h->k_fold = mpt_shift_k(4 * h->stream_bytes);
    h->k_s0 = mpt_shift_k(3 * h->stream_bytes);
    h->k_s1 = mpt_shift_k(2 * h->stream_bytes);
    h->k_s2 = mpt_shift_k(h->stream_bytes);
}

/* Z_D(c) for k = mpt_shift_k(D). */
MPT_CLMUL_TARGET static inline uint32_t mpt_shift_clmul(uint32_t c, uint64_t k)
{
    __m128i prod = _mm_clmulepi64_si128(_mm_cvtsi64_si128((long long)((uint64_t)c << 32)),
                                        _mm_cvtsi64_si128((long long)k), 0x00);
    return (uint32_t)_mm_crc32_u64(0, (uint64_t)_mm_extract_epi64(prod, 1));
}

/* The CRC of a chunk from the running one and its parts' registers (all from zero). */
MPT_CLMUL_TARGET static inline uint32_t mpt_hybrid_join(const struct mpt_hybrid *h,
                                                        uint32_t crc, uint32_t cf,
                                                        const uint32_t c[4])
{
    return mpt_shift_clmul(crc, h->k_chunk) ^ mpt_shift_clmul(cf, h->k_fold) ^
           mpt_shift_clmul(c[0], h->k_s0) ^ mpt_shift_clmul(c[1], h->k_s1) ^
           mpt_shift_clmul(c[2], h->k_s2) ^ c[3];
}

/* crc32 of an 8-byte word in a register. Written as the instruction because compilers
 * fold the load into it (crc32 r64, m64), and with that form the hybrid loops below
 * overlapped less on Zen 3 (31 against 37 GB/s over 256 KiB, measured). */
MPT_HW_TARGET static inline uint32_t mpt_crc32_word(uint32_t crc, const unsigned char *p)
{
    uint64_t c = crc, v = mpt_load64(p);
    __asm__("crc32q %1, %0" : "+r"(c) : "r"(v));
    return (uint32_t)c;
}

/* One word of each of the four streams, s the first stream's next word. */
#define MPT_STREAMS_STEP(c, s, ls)                                                         \
    do {                                                                                   \
        (c)[0] = mpt_crc32_word((c)[0], (s));                                              \
        (c)[1] = mpt_crc32_word((c)[1], (s) + (ls));                                       \
        (c)[2] = mpt_crc32_word((c)[2], (s) + 2 * (ls));                                   \
        (c)[3] = mpt_crc32_word((c)[3], (s) + 3 * (ls));                                   \
        (s) += 8;                                                                          \
    } while (0)

/* A round's worth of stream words in one go (the first round, whose registers only load). */
#define MPT_STREAMS_ROUND(c, s, ls, words)                                                 \
    do {                                                                                   \
        for (int w_ = 0; w_ < (words); w_++)                                               \
            MPT_STREAMS_STEP(c, s, ls);                                                    \
    } while (0)

/* Whole chunks through the 256-bit hybrid; the rest (< a chunk) by mpt_crc_avx2 or, below
 * its minimum, the sse4.2 path. n >= MPT_AVX2_MIN. */
MPT_AVX2_TARGET static uint32_t mpt_crc_avx2_hybrid(uint32_t crc, const unsigned char *p,
                                                    size_t n)
{
    const struct mpt_hybrid *h = &mpt_hyb_avx2;
    const size_t ls = h->stream_bytes;
    const int words = (int)(ls / MPT_HYB_ROUNDS / 8);

    for (; n >= MPT_HYB_CHUNK; p += MPT_HYB_CHUNK, n -= MPT_HYB_CHUNK) {
        const unsigned char *f = p, *s = p + h->fold_bytes;
        uint32_t c[4] = {0, 0, 0, 0};
        __m256i x0 = mpt_loadu256(f), x1 = mpt_loadu256(f + 32);
        __m256i x2 = mpt_loadu256(f + 64), x3 = mpt_loadu256(f + 96);
        __m256i x4 = mpt_loadu256(f + 128), x5 = mpt_loadu256(f + 160);
        __m256i x6 = mpt_loadu256(f + 192), x7 = mpt_loadu256(f + 224);
        __m256i k = mpt_k256(256);

        MPT_STREAMS_ROUND(c, s, ls, words);
        /* one register's products, then one word of each stream: issued side by side,
         * the two units overlap (a whole round of each in turn did not, measured) */
        for (int r = 1; r < MPT_HYB_ROUNDS; r++) {
            f += 256;
            x0 = mpt_fold256(x0, k, mpt_loadu256(f));
            MPT_STREAMS_STEP(c, s, ls);
            x1 = mpt_fold256(x1, k, mpt_loadu256(f + 32));
            MPT_STREAMS_STEP(c, s, ls);
            x2 = mpt_fold256(x2, k, mpt_loadu256(f + 64));
            MPT_STREAMS_STEP(c, s, ls);
            x3 = mpt_fold256(x3, k, mpt_loadu256(f + 96));
            MPT_STREAMS_STEP(c, s, ls);
            x4 = mpt_fold256(x4, k, mpt_loadu256(f + 128));
            MPT_STREAMS_STEP(c, s, ls);
            x5 = mpt_fold256(x5, k, mpt_loadu256(f + 160));
            MPT_STREAMS_STEP(c, s, ls);
            x6 = mpt_fold256(x6, k, mpt_loadu256(f + 192));
            MPT_STREAMS_STEP(c, s, ls);
            x7 = mpt_fold256(x7, k, mpt_loadu256(f + 224));
            MPT_STREAMS_STEP(c, s, ls);
        }
        crc = mpt_hybrid_join(h, crc, mpt_reduce256(x0, x1, x2, x3, x4, x5, x6, x7), c);
    }
    if (n >= MPT_AVX2_MIN)
        return mpt_crc_avx2(crc, p, n);
    return mpt_crc_hw(crc, p, n);
}

/* Whole chunks through the 128-bit hybrid; the rest by the sse4.2 path (as fast as
 * 128-bit folding alone, which issues no more products a cycle). */
MPT_CLMUL_TARGET static uint32_t mpt_crc_pclmul_hybrid(uint32_t crc, const unsigned char *p,
                                                       size_t n)
{
    const struct mpt_hybrid *h = &mpt_hyb_pclmul;
    const size_t ls = h->stream_bytes;
    const int words = (int)(ls / MPT_HYB_ROUNDS / 8);

    for (; n >= MPT_HYB_CHUNK; p += MPT_HYB_CHUNK, n -= MPT_HYB_CHUNK) {
        const unsigned char *f = p, *s = p + h->fold_bytes;
        uint32_t c[4] = {0, 0, 0, 0};
        __m128i x0 = mpt_loadu128(f), x1 = mpt_loadu128(f + 16);
        __m128i x2 = mpt_loadu128(f + 32), x3 = mpt_loadu128(f + 48);
        __m128i x4 = mpt_loadu128(f + 64), x5 = mpt_loadu128(f + 80);
        __m128i x6 = mpt_loadu128(f + 96), x7 = mpt_loadu128(f + 112);
        __m128i k = mpt_k128(128);

        MPT_STREAMS_ROUND(c, s, ls, words);
        for (int r = 1; r < MPT_HYB_ROUNDS; r++) { /* 12 stream words a round */
            f += 128;
            x0 = mpt_fold128(x0, k, mpt_loadu128(f));
            MPT_STREAMS_STEP(c, s, ls);
            MPT_STREAMS_STEP(c, s, ls);
            x1 = mpt_fold128(x1, k, mpt_loadu128(f + 16));
            MPT_STREAMS_STEP(c, s, ls);
            x2 = mpt_fold128(x2, k, mpt_loadu128(f + 32));
            MPT_STREAMS_STEP(c, s, ls);
            MPT_STREAMS_STEP(c, s, ls);
            x3 = mpt_fold128(x3, k, mpt_loadu128(f + 48));
            MPT_STREAMS_STEP(c, s, ls);
            x4 = mpt_fold128(x4, k, mpt_loadu128(f + 64));
            MPT_STREAMS_STEP(c, s, ls);
            MPT_STREAMS_STEP(c, s, ls);
            x5 = mpt_fold128(x5, k, mpt_loadu128(f + 80));
            MPT_STREAMS_STEP(c, s, ls);
            x6 = mpt_fold128(x6, k, mpt_loadu128(f + 96));
            MPT_STREAMS_STEP(c, s, ls);
            MPT_STREAMS_STEP(c, s, ls);
            x7 = mpt_fold128(x7, k, mpt_loadu128(f + 112));
            MPT_STREAMS_STEP(c, s, ls);
        }
        crc = mpt_hybrid_join(h, crc, mpt_reduce128(x0, x1, x2, x3, x4, x5, x6, x7), c);
    }
    return mpt_crc_hw(crc, p, n);
}
#endif /* MPT_CRC_FOLD */

/* -- which paths this CPU runs ----------------------------------------------------------------
 *
 * For each path, what it needs and the CPU lacks (empty: it runs here), so that a path
 * asked for by name and refused says why. Feature names are /proc/cpuinfo's flags. */

enum { MPT_LACKS_BYTES = 160 };
static char mpt_lacks_avx512[MPT_LACKS_BYTES], mpt_lacks_avx2[MPT_LACKS_BYTES];
static char mpt_lacks_pclmul[MPT_LACKS_BYTES], mpt_lacks_hw[MPT_LACKS_BYTES];
static char mpt_lacks_armv8[MPT_LACKS_BYTES];

/* Unless the CPU has it, add what to the list out. */
static void mpt_lack(char *out, int have, const char *what)
{
    size_t used = strlen(out);
    if (!have)
        snprintf(out + used, MPT_LACKS_BYTES - used, "%s%s", used ? ", " : "", what);
}

#if defined(__x86_64__) && defined(MPT_CRC_FOLD)
/* XCR0, the register state the kernel saves and restores; only meaningful with OSXSAVE.
 * Written as the instruction so that no xsave target is needed. */
static uint64_t mpt_xgetbv0(void)
{
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

#define MPT_XCR0_YMM 0x06u /* SSE and AVX (upper YMM) state */
#define MPT_XCR0_ZMM 0xE6u /* those, opmask, upper ZMM 0-15 and ZMM 16-31 state */

static void mpt_cpu_detect(void)
{
    unsigned a, b, c, d;
    unsigned ecx1 = 0, ebx7 = 0, ecx7 = 0;
    uint64_t xcr0 = 0;
    int sse42, pclmul, avx2, vpclmul, avx512f, ymm_os, zmm_os;

    if (__get_cpuid(1, &a, &b, &c, &d))
        ecx1 = c;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        ebx7 = b;
        ecx7 = c;
    }
    if (ecx1 & bit_OSXSAVE)
        xcr0 = mpt_xgetbv0();
    sse42 = (ecx1 & bit_SSE4_2) != 0;
    pclmul = (ecx1 & bit_PCLMUL) != 0;
    avx2 = (ecx1 & bit_AVX) && (ebx7 & bit_AVX2);
    vpclmul = (ecx7 & bit_VPCLMULQDQ) != 0;
    avx512f = (ebx7 & bit_AVX512F) != 0;
    ymm_os = (xcr0 & MPT_XCR0_YMM) == MPT_XCR0_YMM;
    zmm_os = (xcr0 & MPT_XCR0_ZMM) == MPT_XCR0_ZMM;

    mpt_lack(mpt_lacks_hw, sse42, "sse4_2");
    memcpy(mpt_lacks_pclmul, mpt_lacks_hw, sizeof mpt_lacks_hw);
    mpt_lack(mpt_lacks_pclmul, pclmul, "pclmulqdq");
    memcpy(mpt_lacks_avx2, mpt_lacks_pclmul, sizeof mpt_lacks_pclmul);
    memcpy(mpt_lacks_avx512, mpt_lacks_pclmul, sizeof mpt_lacks_pclmul);
    mpt_lack(mpt_lacks_avx2, avx2, "avx2");
    mpt_lack(mpt_lacks_avx2, vpclmul, "vpclmulqdq");
    mpt_lack(mpt_lacks_avx2, ymm_os, "AVX register state enabled by the kernel (XCR0)");
    mpt_lack(mpt_lacks_avx512, avx512f, "avx512f");
    mpt_lack(mpt_lacks_avx512, vpclmul, "vpclmulqdq");
    mpt_lack(mpt_lacks_avx512, zmm_os, "AVX-512 register state enabled by the kernel (XCR0)");
    mpt_lack(mpt_lacks_armv8, 0, "an aarch64 CPU");
}
#else
static void mpt_cpu_detect(void)
{
    static const char *x86 = "an x86-64 CPU (and a GCC or clang build)";
    mpt_lack(mpt_lacks_avx512, 0, x86);
    mpt_lack(mpt_lacks_avx2, 0, x86);
    mpt_lack(mpt_lacks_pclmul, 0, x86);
    mpt_lack(mpt_lacks_hw, 0, x86);
#if defined(MPT_CRC_HW)
    mpt_lack(mpt_lacks_armv8, (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0,
             "crc32 (the ARMv8 CRC32 instructions)");
#else
    mpt_lack(mpt_lacks_armv8, 0, "an aarch64 CPU (and a GCC or clang build)");
#endif
}
#endif

/* Every path by name, fastest first; a path runs here when it lacks nothing. */
static const struct {
    const char *name;
    int impl;
    const char *lacks;
} mpt_crc_paths[] = {
    {"avx512-vpclmulqdq", MPT_CRC32C_AVX512, mpt_lacks_avx512},
    {"avx2-vpclmulqdq", MPT_CRC32C_AVX2, mpt_lacks_avx2},
    {"pclmulqdq", MPT_CRC32C_PCLMUL, mpt_lacks_pclmul},
    {"sse4.2", MPT_CRC32C_HW, mpt_lacks_hw},
    {"armv8-crc", MPT_CRC32C_HW, mpt_lacks_armv8},
    {"table", MPT_CRC32C_TABLE, ""},
};
#define MPT_N_PATHS (sizeof mpt_crc_paths / sizeof mpt_crc_paths[0])

static char mpt_impls[128]; /* mpt_crc32c_impls(): the names that run here, best first */

static int mpt_fastest(void)
{
    for (size_t i = 0; i < MPT_N_PATHS; i++)
        if (mpt_crc_paths[i].lacks[0] == '\0')
            return mpt_crc_paths[i].impl;
    return MPT_CRC32C_TABLE;
}

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
#ifdef MPT_CRC_FOLD
    mpt_fold_init();
    mpt_hybrid_init(&mpt_hyb_avx2);
    mpt_hybrid_init(&mpt_hyb_pclmul);
#endif
    mpt_cpu_detect();
#ifdef MPT_CRC_HW
    mpt_have_hw = mpt_lacks_hw[0] == '\0' || mpt_lacks_armv8[0] == '\0';
#endif
    mpt_have_pclmul = mpt_lacks_pclmul[0] == '\0';
    mpt_have_avx2 = mpt_lacks_avx2[0] == '\0';
    mpt_have_avx512 = mpt_lacks_avx512[0] == '\0';
    for (size_t i = 0; i < MPT_N_PATHS; i++)
        if (mpt_crc_paths[i].lacks[0] == '\0') {
            size_t used = strlen(mpt_impls);
            snprintf(mpt_impls + used, sizeof mpt_impls - used, "%s%s", used ? "," : "",
                     mpt_crc_paths[i].name);
        }
    __atomic_store_n(&mpt_crc_best, mpt_fastest(), __ATOMIC_RELAXED);
}

uint32_t mpt_crc32c(uint32_t crc, const char *p, size_t n, int impl)
{
    const unsigned char *u = (const unsigned char *)p;

    pthread_once(&mpt_crc_once, mpt_crc_init);
    if (impl == MPT_CRC32C_BEST)
        impl = __atomic_load_n(&mpt_crc_best, __ATOMIC_RELAXED);
    crc = ~crc;
#ifdef MPT_CRC_FOLD
    /* A folding path this CPU lacks, or too short an input for it: the sse4.2 path. */
    if (impl == MPT_CRC32C_AVX512 && mpt_have_avx512 && n >= MPT_AVX512_MIN)
        return ~mpt_crc_avx512(crc, u, n);
    if (impl == MPT_CRC32C_AVX2 && mpt_have_avx2 && n >= MPT_AVX2_MIN)
        return ~mpt_crc_avx2_hybrid(crc, u, n);
    if (impl == MPT_CRC32C_PCLMUL && mpt_have_pclmul && n >= MPT_HYB_CHUNK)
        return ~mpt_crc_pclmul_hybrid(crc, u, n);
#endif
#ifdef MPT_CRC_HW
    if (mpt_have_hw && impl != MPT_CRC32C_TABLE)
        return ~mpt_crc_hw(crc, u, n);
#endif
    return ~mpt_crc_table(crc, u, n);
}

/* mpt_crc32c_copy's piece: the CRC reads each piece from the cache the copy just
 * filled, where a whole 2 MiB block copied first is read back from farther out.
 * Measured (bench/experiments/store_copy_crc.c; AMD EPYC VM, avx2-vpclmulqdq, the
 * source out of cache, six rounds): 1.10-1.21x the rate of a whole copy then its CRC at
 * 2 MiB, 0.83-1.37x (median 1.02) at 256 KiB, a block that fits in L2 either way.
 * Pieces of 64 KiB did as well at 2 MiB, 32 KiB a little worse (1.04-1.21x). */
#define MPT_COPY_CRC_PIECE (128 * 1024)

uint32_t mpt_crc32c_copy(uint32_t crc, char *dst, const char *src, size_t n)
{
    for (size_t done = 0; done < n; done += MPT_COPY_CRC_PIECE) {
        size_t part = n - done < MPT_COPY_CRC_PIECE ? n - done : MPT_COPY_CRC_PIECE;
        memcpy(dst + done, src + done, part);
        crc = mpt_crc32c(crc, dst + done, part, MPT_CRC32C_BEST);
    }
    return crc;
}

const char *mpt_crc32c_impls(void)
{
    pthread_once(&mpt_crc_once, mpt_crc_init);
    return mpt_impls;
}

const char *mpt_crc32c_lacks(const char *name)
{
    pthread_once(&mpt_crc_once, mpt_crc_init);
    for (size_t i = 0; i < MPT_N_PATHS; i++)
        if (strcmp(name, mpt_crc_paths[i].name) == 0)
            return mpt_crc_paths[i].lacks;
    return NULL;
}

int mpt_crc32c_select(const char *name)
{
    pthread_once(&mpt_crc_once, mpt_crc_init);
    if (name == NULL) {
        __atomic_store_n(&mpt_crc_best, mpt_fastest(), __ATOMIC_RELAXED);
        return 0;
    }
    for (size_t i = 0; i < MPT_N_PATHS; i++)
        if (strcmp(name, mpt_crc_paths[i].name) == 0) {
            if (mpt_crc_paths[i].lacks[0] != '\0')
                return -ENOTSUP;
            __atomic_store_n(&mpt_crc_best, mpt_crc_paths[i].impl, __ATOMIC_RELAXED);
            return 0;
        }
    return -EINVAL;
}

const char *mpt_crc32c_selected(void)
{
    int impl;

    pthread_once(&mpt_crc_once, mpt_crc_init);
    impl = __atomic_load_n(&mpt_crc_best, __ATOMIC_RELAXED);
    for (size_t i = 0; i < MPT_N_PATHS; i++)
        if (mpt_crc_paths[i].impl == impl && mpt_crc_paths[i].lacks[0] == '\0')
            return mpt_crc_paths[i].name;
    return "table";
}
