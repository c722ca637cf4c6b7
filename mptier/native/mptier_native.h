/*
 * mptier_native.h - what the C files of the native core share.
 *
 * mptier_io.c   batch store / load / lookup
 * resolve.c     reaching a path beneath the root without following a symlink
 * crc32c.c      CRC32C (AVX-512 folding / SSE4.2 / ARMv8 CRC / tables)
 * direct.c      checksummed O_DIRECT I/O overlapped with the device (Linux AIO)
 * probes.c      what a directory's file system supports
 *
 * build_ffi.py's cdef declares the interface part to Python (cffi reads the constants'
 * values from here); _pure.py mirrors the constants and is checked against them.
 */

#ifndef MPTIER_NATIVE_H
#define MPTIER_NATIVE_H

#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Flags of the batch calls (bit values are part of the Python API: mptier.native.*). */
#define MPT_O_DIRECT 1   /* O_DIRECT for blocks whose address and size are aligned */
#define MPT_CHECKSUM 2   /* store: write the CRC32C record; load: verify it if present */
#define MPT_TOUCH 4      /* set atime to now on a load, and on a store that finds the block */
#define MPT_TMPFILE 8    /* store through an unnamed O_TMPFILE file linked into place */
#define MPT_NO_OPENAT2 16 /* resolve paths with the O_NOFOLLOW walk even where openat2 exists */

/* Alignment O_DIRECT needs for the user address, the length and the file offset.
 * 4096 covers both 512-byte and 4 KiB logical sectors. */
#define MPT_DIRECT_ALIGN 4096

/* A writer's tag (its lease name) is exactly this many characters of [0-9a-z]. */
#define MPT_TAG_LEN 16
/* Longest temporary suffix: "." tag "." counter (uint64, at most 20 digits) ".tmp". */
#define MPT_TEMP_SUFFIX_MAX_BYTES (1 + MPT_TAG_LEN + 1 + 20 + 4)

/* Lookup status, one byte per path. */
#define MPT_LOOKUP_ABSENT 0  /* nothing there (or the path cannot be reached) */
#define MPT_LOOKUP_PRESENT 1 /* a regular file of exactly block_bytes */
#define MPT_LOOKUP_SYMLINK 2 /* a symlink at the leaf or a sub-folder: removed, a miss */
#define MPT_LOOKUP_BAD 3     /* not a regular file, longer than a block, or a non-directory
                              * where a sub-folder must be: left in place, a miss */
#define MPT_LOOKUP_SHORT 4   /* a regular file shorter than a block (empty included):
                              * corrupt, a miss; left for the next store or load to remove */

/* CRC32C implementations for mpt_crc32c's impl argument. */
#define MPT_CRC32C_BEST 0  /* the fastest this CPU has (chosen once, at first use) */
#define MPT_CRC32C_TABLE 1 /* the portable table-driven code, whatever the CPU */
#define MPT_CRC32C_HW 2    /* the CRC instruction (SSE4.2 / ARMv8), three streams */
#define MPT_CRC32C_FOLD 3  /* carry-less multiply folding (AVX-512 VPCLMULQDQ) */

/* vLLM's checksum record: CRC32C of the block, 4 bytes big-endian, in this attribute. */
#define MPT_XATTR_NAME "user.vllm.kv_crc32c"

/* -- the Python interface (build_ffi.py's cdef declares the same) ----------------------- */

int mpt_batch_store(int root, const char *paths_blob, size_t n, char *base,
                    const uint64_t *offsets, size_t block_bytes, int flags, const char *tag,
                    size_t *n_done, size_t *fail_index, int *tmp_unlink_errno);
int mpt_batch_load(int root, const char *paths_blob, size_t n, char *base,
                   const uint64_t *offsets, size_t block_bytes, int flags, size_t *n_done,
                   size_t *fail_index);
int mpt_batch_lookup(int root, const char *paths_blob, size_t n, size_t block_bytes,
                     int flags, uint8_t *out);
int mpt_probe_o_direct(const char *dir);
int mpt_probe_xattr(const char *dir);
int mpt_probe_o_tmpfile(const char *dir);
/* CRC32C (Castagnoli) of n bytes at p, continuing from crc (0 to start), as zlib's
 * crc32() continues: crc(a + b) == crc(b, crc(a)). */
uint32_t mpt_crc32c(uint32_t crc, const char *p, size_t n, int impl);
/* The implementations this CPU runs, best first, comma-separated: e.g.
 * "avx512-vpclmulqdq,sse4.2,table". An impl it lacks falls back to the next one. */
const char *mpt_crc32c_impls(void);
/* "openat2" or "walk": how paths resolve beneath a root without MPT_NO_OPENAT2. */
const char *mpt_resolver(void);
const char *mpt_xattr_name(void);

/* -- shared between the C files only ------------------------------------------------------- */

#define MPT_INTERNAL __attribute__((visibility("hidden")))

#ifndef O_DIRECT
#define O_DIRECT 0 /* no direct I/O on this platform: every block goes buffered */
#endif
#ifndef EMEDIUMTYPE
#define EMEDIUMTYPE EINVAL
#endif
#ifndef ENOTSUP
#define ENOTSUP EOPNOTSUPP
#endif

/* Creating a folder and opening it again can lose a race against a process that removes
 * empty folders (or a symlink may be put back); a few rounds are plenty. */
#define MPT_MKDIR_TRIES 3

/* resolve.c */
MPT_INTERNAL int mpt_openat(int dirfd, const char *name, int oflags, mode_t mode);
MPT_INTERNAL void mpt_close_dir(int dirfd, int root);
MPT_INTERNAL const char *mpt_leaf(const char *rel);
MPT_INTERNAL int mpt_unlink_symlink(int dirfd, const char *name);
MPT_INTERNAL int mpt_open_parent(int root, const char *rel, int flags, int create);
MPT_INTERNAL int mpt_open_beneath(int root, const char *rel, int oflags, int flags);
MPT_INTERNAL void mpt_remove_if_same(int root, const char *rel, int flags, dev_t dev,
                                     ino_t ino);
/* mptier_io.c */
MPT_INTERNAL uint64_t mpt_next_counter(void);
MPT_INTERNAL int mpt_write_all(int fd, const char *p, size_t len);
MPT_INTERNAL int mpt_pwrite_all(int fd, const char *p, size_t len, size_t offset);
MPT_INTERNAL int mpt_set_record(int fd, uint32_t crc);
MPT_INTERNAL int mpt_link_tmpfile(int fd, int dirfd, const char *leaf);
/* direct.c: 0, -errno, or MPT_NO_AIO (nothing done: use synchronous I/O) */
#define MPT_NO_AIO 1
MPT_INTERNAL int mpt_direct_write_crc(int fd, const char *src, size_t len, uint32_t *crc);
MPT_INTERNAL int mpt_direct_read_crc(int fd, char *dst, size_t len, uint32_t *crc);

#endif
