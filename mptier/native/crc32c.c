/*
 * crc32c.c - CRC32C (Castagnoli), the checksum of vLLM's block record.
 *
 * Reflected polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF; check value
 * crc32c("123456789") == 0xE3069283. Four implementations, chosen once at run time
 * (cpuid / getauxval), each a fallback for the one above it:
 *
 *   x86-64   AVX-512 VPCLMULQDQ folding   carry-less multiplication, 256 bytes a round
 *   x86-64   SSE4.2 "crc32" instruction   \  three independent streams over a chunk,
 *   aarch64  ARMv8 CRC32C instructions    /  joined with a table-driven shift operator
 *   any      slicing-by-8 tables (portable; MPT_CRC32C_TABLE forces it for tests)
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
 * streams make 8 bytes a cycle, about three times a memory copy's speed, so checksums
 * would cost a quarter of a copy-bound (tmpfs) store or load; carry-less products of
 * 512-bit registers go two to four times faster. The tables and constants are built
 * at first use, from the polynomial alone.
 *
 * The SIMD functions carry target attributes, so the file builds without -msse4.2 or
 * -mavx512f and runs everywhere; the CPU check decides whether they are ever called.
 */

#include "mptier_native.h"

#include <pthread.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define MPT_CRC_HW "sse4.2"
#define MPT_CRC_FOLD "avx512-vpclmulqdq"
#define MPT_FOLD_TARGET __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))
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
/* Below this many bytes folding's setup and final joins cost more than they save. */
#define MPT_FOLD_MIN 512

static uint32_t mpt_slice[8][256];     /* slicing-by-8 tables; [0] is the byte table */
static uint32_t mpt_zeros_long[2][4][256];  /* Z_LONG, Z_2LONG as per-byte tables */
static uint32_t mpt_zeros_short[2][4][256]; /* Z_SHORT, Z_2SHORT */
static int mpt_have_hw;
static int mpt_have_fold;
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

#ifdef MPT_CRC_FOLD
/* -- the folding path: carry-less multiplication, 256 bytes a round -------------------------
 *
 * The message is a polynomial over GF(2); its CRC depends only on it modulo P. Folding
 * keeps a 128-bit lane L of the message (as a polynomial, the first byte's low bit the
 * highest power) and moves it D bits further on: L * x^D mod P, i.e.
 *
 *   lo * (x^(D+64) mod P) + hi * (x^D mod P)      lo, hi: the lane's two 64-bit halves
 *
 * each a 64 x 32-bit carry-less product that fits back into a lane, and is XORed into
 * the data standing there. Bit-reflected operands make a product come out one bit
 * short, so the constants are x^(D+63) and x^(D-1) instead. Sixteen lanes (four
 * 512-bit registers) advance together by 256 bytes a round; at the end they are folded
 * onto the last lane, whose 16 bytes then have the message's CRC (the starting CRC was
 * XORed into the first four bytes, which for a reflected CRC is the same thing).
 */

static uint64_t mpt_fold_k[17][2]; /* [d / 16]: fold constants for d bytes */

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
    static const unsigned distances[] = {16, 32, 48, 64, 128, 192, 256};
    for (size_t i = 0; i < sizeof distances / sizeof distances[0]; i++) {
        unsigned bits = 8 * distances[i];
        /* as a 64-bit reflected operand, coefficient x^d sits at bit 63 - d */
        mpt_fold_k[distances[i] / 16][0] = (uint64_t)mpt_xpow_mod(bits + 63) << 32;
        mpt_fold_k[distances[i] / 16][1] = (uint64_t)mpt_xpow_mod(bits - 1) << 32;
    }
}

MPT_FOLD_TARGET static inline __m512i mpt_k512(unsigned bytes)
{
    const uint64_t *k = mpt_fold_k[bytes / 16];
    return _mm512_broadcast_i32x4(_mm_set_epi64x((long long)k[1], (long long)k[0]));
}

MPT_FOLD_TARGET static inline __m128i mpt_k128(unsigned bytes)
{
    const uint64_t *k = mpt_fold_k[bytes / 16];
    return _mm_set_epi64x((long long)k[1], (long long)k[0]);
}

/* Each 128-bit lane of a, moved on by k's distance, XOR data. */
MPT_FOLD_TARGET static inline __m512i mpt_fold512(__m512i a, __m512i k, __m512i data)
{
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a, k, 0x00),
                                     _mm512_clmulepi64_epi128(a, k, 0x11), data, 0x96);
}

MPT_FOLD_TARGET static inline __m128i mpt_fold128(__m128i a, __m128i k, __m128i data)
{
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(a, k, 0x00),
                                       _mm_clmulepi64_si128(a, k, 0x11)), data);
}

/* n >= MPT_FOLD_MIN. */
MPT_FOLD_TARGET static uint32_t mpt_crc_fold(uint32_t crc, const unsigned char *p, size_t n)
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
    for (; n >= 16; p += 16, n -= 16)
        a = mpt_fold128(a, mpt_k128(16), _mm_loadu_si128((const __m128i *)p));
    crc = (uint32_t)_mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(a));
    crc = (uint32_t)_mm_crc32_u64(crc, (uint64_t)_mm_extract_epi64(a, 1));
    return mpt_crc_hw(crc, p, n);
}
#endif /* MPT_CRC_FOLD */

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
#ifdef MPT_CRC_FOLD
    mpt_fold_init();
    mpt_have_fold = mpt_have_hw && __builtin_cpu_supports("avx512f") &&
                    __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul");
#endif
}

uint32_t mpt_crc32c(uint32_t crc, const char *p, size_t n, int impl)
{
    const unsigned char *u = (const unsigned char *)p;

    pthread_once(&mpt_crc_once, mpt_crc_init);
    crc = ~crc;
#ifdef MPT_CRC_FOLD
    if (mpt_have_fold && n >= MPT_FOLD_MIN && (impl == MPT_CRC32C_BEST || impl == MPT_CRC32C_FOLD))
        return ~mpt_crc_fold(crc, u, n);
#endif
#ifdef MPT_CRC_HW
    if (mpt_have_hw && impl != MPT_CRC32C_TABLE)
        return ~mpt_crc_hw(crc, u, n);
#endif
    return ~mpt_crc_table(crc, u, n);
}

const char *mpt_crc32c_impls(void)
{
    pthread_once(&mpt_crc_once, mpt_crc_init);
#ifdef MPT_CRC_FOLD
    if (mpt_have_fold)
        return MPT_CRC_FOLD "," MPT_CRC_HW ",table";
#endif
#ifdef MPT_CRC_HW
    if (mpt_have_hw)
        return MPT_CRC_HW ",table";
#endif
    return "table";
}
