/*
 * mptier_native.h - what the C files of the native core share.
 *
 * The C files stand in floors: each calls only into files on the floors below it (and
 * its own), never up and never in a circle (tests/test_structure.py checks it).
 *
 *   4  mptier_io.c   batch store / load / lookup: the Python interface's I/O calls
 *   3  uring.c       the batch calls' io_uring path (MPT_URING): many blocks in flight
 *   3  probes.c      what a directory's file system supports
 *   2  block.c       one block the system-call way (load, store, evict), its checksum record
 *   1  direct.c      checksummed O_DIRECT I/O overlapped with the device (Linux AIO)
 *   0  fdio.c        whole writes on a descriptor
 *   0  resolve.c     reaching a path beneath the root without following a symlink
 *   0  crc32c.c      CRC32C (VPCLMULQDQ / PCLMULQDQ folding, SSE4.2, ARMv8 CRC, tables)
 *   0  encode.c      the engine's task records (mptier.jobs' wire format)
 *   0  queue.c       a worker's take of a task record from its queues
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
#define MPT_URING 32      /* store / load through io_uring, several blocks in flight, where
                           * this process can use it (probed once); else the syscall loop.
                           * Same results, except what a failed batch leaves undefined
                           * anyway: a load's memory for blocks after the failing one may
                           * hold their data (never reported as loaded), a store may have
                           * made empty folders for them (nothing after it is published) */

#define MPT_WHOLE_BOUNCE 64 /* bounced load through io_uring: every bounce slot's read in
                             * flight at once, not in waves (uring.c, MPT_WAVE_SHARE) */
#define MPT_LOOP_LOOKUP 128 /* a lookup with MPT_URING: one key after another, as without
                             * it, not every key's open in the ring (side by side) */

/* Alignment O_DIRECT needs for the user address, the length and the file offset.
 * 4096 covers both 512-byte and 4 KiB logical sectors. */
#define MPT_DIRECT_ALIGN 4096

/* A writer's tag (its lease name) is exactly this many characters of [0-9a-z]. */
#define MPT_TAG_LEN 16
/* Longest temporary suffix: "." tag "." counter (uint64, at most 20 digits) ".tmp". */
#define MPT_TEMP_SUFFIX_MAX_BYTES (1 + MPT_TAG_LEN + 1 + 20 + 4)

/* Task records (mptier.jobs): the wire version, the fixed record size (PIPE_BUF: one
 * atomic pipe write) and the header before the items. */
#define MPT_WIRE_VERSION 3
#define MPT_TASK_RECORD_BYTES 4096
#define MPT_TASK_HEADER_BYTES 20
#define MPT_KIND_STORE 1
#define MPT_KIND_LOAD 2
#define MPT_KIND_LOOKUP 3 /* lookup records carry no block ids */
/* Most items a store or load record holds (a block id and a key length each), and the
 * most bytes the paths of its keys take with their NULs (mpt_task_items): a path is at
 * most 2 hex digits per key byte plus 24 ("xxx/xx_g<10 digits>/", ".bin", the NUL), and
 * an item takes 10 record bytes and its key's (at most 2.4 path bytes per record byte).
 * A lookup record's items take 2 bytes and the key's: up to 12 path bytes each. */
#define MPT_TASK_MAX_ITEMS ((MPT_TASK_RECORD_BYTES - MPT_TASK_HEADER_BYTES) / 10)
#define MPT_TASK_PATHS_BYTES (3 * (MPT_TASK_RECORD_BYTES - MPT_TASK_HEADER_BYTES))
#define MPT_LOOKUP_PATHS_BYTES (12 * (MPT_TASK_RECORD_BYTES - MPT_TASK_HEADER_BYTES))
/* A key's last bytes are its KV-cache group index, big-endian (mptier.keys). */
#define MPT_GROUP_IDX_BYTES 4

/* Lookup status, one byte per path. */
#define MPT_LOOKUP_ABSENT 0  /* nothing there (or the path cannot be reached) */
#define MPT_LOOKUP_PRESENT 1 /* a regular file of exactly block_bytes */
#define MPT_LOOKUP_SYMLINK 2 /* a symlink at the leaf or a sub-folder: removed, a miss */
#define MPT_LOOKUP_BAD 3     /* not a regular file, longer than a block, or a non-directory
                              * where a sub-folder must be: left in place, a miss */
#define MPT_LOOKUP_SHORT 4   /* a regular file shorter than a block (empty included):
                              * corrupt, a miss; left for the next store or load to remove */

/* CRC32C implementations for mpt_crc32c's impl argument. */
#define MPT_CRC32C_BEST 0   /* the fastest this CPU has, or what mpt_crc32c_select named */
#define MPT_CRC32C_TABLE 1  /* the portable table-driven code, whatever the CPU */
#define MPT_CRC32C_HW 2     /* the CRC instruction (SSE4.2 / ARMv8), three streams */
#define MPT_CRC32C_AVX512 3 /* carry-less multiply folding, VPCLMULQDQ on 512-bit registers */
#define MPT_CRC32C_AVX2 4   /* the same on 256-bit registers (AVX2 + VPCLMULQDQ) */
#define MPT_CRC32C_PCLMUL 5 /* the same on 128-bit registers (PCLMULQDQ) */

/* vLLM's checksum record: CRC32C of the block, 4 bytes big-endian, in this attribute. */
#define MPT_XATTR_NAME "user.vllm.kv_crc32c"

/* -- the Python interface (build_ffi.py's cdef declares the same) ----------------------- */

/* Store / load: 0, or -errno of block *fail_index; blocks 0 .. *n_done - 1 (= *fail_index)
 * are done, nothing after *fail_index is published, removed or touched, and a load's
 * memory from *fail_index on is undefined (see MPT_URING). All I/O into base has ended
 * when they return. A block not wholly inside base[0, base_len) fails with EINVAL before
 * any of its I/O (base_len: the caller's own mapping, never a number it was sent).
 * A store's found (or NULL) gets found[i] = 1 for each done block i that was there
 * already, so that it was only touched, and 0 for one it wrote. */
int mpt_batch_store(int root, const char *paths_blob, size_t n, char *base,
                    size_t base_len, const uint64_t *offsets, size_t block_bytes,
                    int flags, const char *tag, size_t *n_done, size_t *fail_index,
                    int *tmp_unlink_errno, uint8_t *found);
/* Store as mpt_batch_store does, but copy each block from base + offsets[i] into one of
 * bounce_blocks slots of block_bytes at bounce (the caller's private memory, in huge pages
 * where it can be) as the block starts, and write it from there: a direct write from the
 * engine's 4 KiB pages hands the device one segment per page, which this VM's disk took
 * at ~0.6x the rate of the same writes from huge pages (mptier.workers.bounce). At most
 * bounce_blocks blocks are in flight. */
int mpt_batch_store_via(int root, const char *paths_blob, size_t n, char *base,
                        size_t base_len, const uint64_t *offsets, size_t block_bytes,
                        int flags, const char *tag, char *bounce, size_t bounce_blocks,
                        size_t *n_done, size_t *fail_index, int *tmp_unlink_errno,
                        uint8_t *found);
int mpt_batch_load(int root, const char *paths_blob, size_t n, char *base, size_t base_len,
                   const uint64_t *offsets, size_t block_bytes, int flags, size_t *n_done,
                   size_t *fail_index);
/* Load as mpt_batch_load does, but read each block into one of bounce_blocks slots of
 * block_bytes at bounce (the caller's private memory, page-aligned for O_DIRECT) and copy
 * it to base + offsets[i] only after its read returned (mptier.workers.bounce): no read
 * in flight ever targets base. With MPT_URING the reads go in waves of at most half the
 * bounce slots and half the blocks, the next sent as the last returns, while that one's
 * blocks are copied (MPT_WHOLE_BOUNCE: up to bounce_blocks at once). A failed block's
 * slot in base is never written. */
int mpt_batch_load_via(int root, const char *paths_blob, size_t n, char *base,
                       size_t base_len, const uint64_t *offsets, size_t block_bytes, int flags, char *bounce,
                       size_t bounce_blocks, size_t *n_done, size_t *fail_index);
int mpt_batch_lookup(int root, const char *paths_blob, size_t n, size_t block_bytes,
                     int flags, uint8_t *out);
int mpt_probe_o_direct(const char *dir);
int mpt_probe_xattr(const char *dir);
int mpt_probe_o_tmpfile(const char *dir);
/* CRC32C (Castagnoli) of n bytes at p, continuing from crc (0 to start), as zlib's
 * crc32() continues: crc(a + b) == crc(b, crc(a)). */
uint32_t mpt_crc32c(uint32_t crc, const char *p, size_t n, int impl);
/* Copy n bytes from src to dst (not overlapping) and return their CRC32C continuing
 * from crc, by the fastest path, piece by piece while each piece is in cache. */
uint32_t mpt_crc32c_copy(uint32_t crc, char *dst, const char *src, size_t n);
/* The implementations ("paths") this CPU runs, best first, comma-separated: e.g.
 * "avx2-vpclmulqdq,pclmulqdq,sse4.2,table". A folding impl the CPU lacks, or an input
 * shorter than it takes, runs the CRC instruction (or the tables, without one). */
const char *mpt_crc32c_impls(void);
/* What this CPU lacks for the path called name ("" when it runs it; feature names as in
 * /proc/cpuinfo), NULL when no path has that name. */
const char *mpt_crc32c_lacks(const char *name);
/* Make the path called name the one MPT_CRC32C_BEST runs in this process (NULL: the
 * fastest again): 0, -EINVAL for no such path, -ENOTSUP when the CPU lacks it. */
int mpt_crc32c_select(const char *name);
/* The name of the path MPT_CRC32C_BEST runs. */
const char *mpt_crc32c_selected(void);
/* "openat2" or "walk": how paths resolve beneath a root without MPT_NO_OPENAT2. */
const char *mpt_resolver(void);
const char *mpt_xattr_name(void);
/* "io_uring" when MPT_URING batches run through io_uring in this process, else why not
 * (e.g. "io_uring_setup: Operation not permitted"): then they take the syscall loop. */
const char *mpt_uring_status(void);
/* 1: dir's file system keeps file data in memory (tmpfs, ramfs), 0: it does not,
 * -errno: dir is unusable. */
int mpt_fs_in_memory(const char *dir);
/* 1: path is a directory with that device and inode now; 0: not; -errno: see probes.c. */
int mpt_same_folder(const char *path, uint64_t dev, uint64_t ino);
/* Evict the block file at path (absolute): 1 when it was removed, with the <h2>_g<group>
 * and <h3> folders above it where that emptied them; 0 when it was kept: gone, not a
 * regular file of size bytes, or changed since it was chosen -- told (a block a worker
 * told, never looked at): its atime is past atime_ns (used since); else: its inode is
 * not ino or its atime not atime_ns. -errno when lstat (not told) or unlink fails
 * otherwise. One call for what eviction does per block, so an unlink thread takes its
 * process's GIL once a block (mptier.workers.evictor). */
int mpt_evict_block(const char *path, uint64_t size, uint64_t ino, int64_t atime_ns,
                    int told);
/* The task records of one job (mptier.jobs.encode_job's bytes): see encode.c. */
int mpt_encode_job(unsigned char *out, size_t out_len, int kind, uint64_t first_task,
                   const unsigned char *keys, size_t key_len, size_t n, const int64_t *ids,
                   size_t per_task);
/* A task record's keys as the layout's paths and its block ids as buffer offsets: see
 * encode.c. */
int mpt_task_items(const unsigned char *record, size_t record_len, size_t block_bytes,
                   char *paths, size_t paths_len, size_t *paths_used, uint64_t *offsets,
                   size_t max_items);
/* Take a task record from the first of a worker's queues that holds one: see queue.c. */
int mpt_take_record(const int *fds, size_t n, unsigned char *record, size_t record_len,
                    int *more);
/* Load the blocks of a store or load task record (mpt_task_items' paths and offsets) as
 * mpt_batch_load does, or as mpt_batch_load_via does through bounce when it is not NULL:
 * the worker's whole load in one call. A record mpt_task_items refuses: -EINVAL and
 * nothing done (the caller checks records first: mptier.jobs.check_task). */
int mpt_task_load(int root, const unsigned char *record, size_t record_len, char *base,
                  size_t base_len, size_t block_bytes, int flags, char *bounce,
                  size_t bounce_blocks, size_t *n_done, size_t *fail_index);

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

/* A temporary name already taken (a crashed writer of the same lease) is skipped by
 * taking the next counter value, this many times at most. */
#define MPT_NAME_TRIES 8

/* statfs f_type of file systems that keep file data in memory
 * (include/uapi/linux/magic.h): there even O_DIRECT I/O is a CPU copy. */
#define MPT_TMPFS_MAGIC 0x01021994
#define MPT_RAMFS_MAGIC 0x858458f6

/* Creating a folder and opening it again can lose a race against a process that removes
 * empty folders (or a symlink may be put back); a few rounds are plenty. */
#define MPT_MKDIR_TRIES 3

/* What one batch shares between its blocks (mptier_io.c, block.c, uring.c). */
struct mpt_batch {
    int root;
    int flags;
    const char *tag;
    int tmp_errno; /* first failure to remove a temporary file (errno), 0 if none */
    int memory_fs; /* the root keeps data in memory: even O_DIRECT I/O is a CPU copy */
    char *bounce;  /* load: read into these slots, then copy (mpt_batch_load_via); or NULL */
    size_t bounce_blocks;
    uint8_t *found; /* store: found[i] = 1 where block i was there already, or NULL */
    int found_one;  /* store: the block mpt_store_one just stored was there already */
};

/* openat2(2)'s argument, kernel ABI (include/uapi/linux/openat2.h). */
struct mpt_open_how {
    uint64_t flags;
    uint64_t mode;
    uint64_t resolve;
};
#define MPT_RESOLVE_NO_SYMLINKS 0x04
#define MPT_RESOLVE_BENEATH 0x08

/* Declared floor by floor, the lowest first (the file list above). */

/* fdio.c: 0 or -errno; offset MPT_AT_POSITION writes at (and moves) the file position */
#define MPT_AT_POSITION ((off_t)-1)
MPT_INTERNAL int mpt_write_at(int fd, const char *p, size_t len, off_t offset);
/* resolve.c */
MPT_INTERNAL int mpt_use_openat2(int flags);
MPT_INTERNAL int mpt_openat(int dirfd, const char *name, int oflags, mode_t mode);
MPT_INTERNAL void mpt_close_dir(int dirfd, int root);
MPT_INTERNAL const char *mpt_leaf(const char *rel);
MPT_INTERNAL int mpt_unlink_symlink(int dirfd, const char *name);
MPT_INTERNAL int mpt_open_parent(int root, const char *rel, int flags, int create);
MPT_INTERNAL int mpt_open_parent_made(int root, const char *rel, int flags, int create,
                                      int *made);
MPT_INTERNAL int mpt_open_beneath(int root, const char *rel, int oflags, int flags);
MPT_INTERNAL void mpt_remove_if_same(int root, const char *rel, int flags, dev_t dev,
                                     ino_t ino);
/* direct.c: 0, -errno, or MPT_NO_AIO (nothing done: use synchronous I/O) */
#define MPT_NO_AIO 1
MPT_INTERNAL int mpt_direct_write_crc(int fd, const char *src, size_t len, uint32_t *crc);
MPT_INTERNAL int mpt_direct_read_crc(int fd, char *dst, size_t len, uint32_t *crc);
/* block.c */
MPT_INTERNAL uint64_t mpt_next_counter(void);
MPT_INTERNAL int mpt_set_record(int fd, uint32_t crc);
MPT_INTERNAL int mpt_link_tmpfile(int fd, int dirfd, const char *leaf);
MPT_INTERNAL int mpt_direct_ok(int flags, const char *p, size_t len);
MPT_INTERNAL int mpt_record_of(int fd, uint32_t *want, int *present);
MPT_INTERNAL void mpt_touch(int fd);
MPT_INTERNAL void mpt_touch_at(int dirfd, const char *leaf);
MPT_INTERNAL void mpt_remove_if_same_fd(int root, const char *rel, int flags, int fd);
MPT_INTERNAL void mpt_unlink_temp(struct mpt_batch *b, int dirfd, const char *tmp);
MPT_INTERNAL int mpt_temp_name(char *out, size_t size, const char *leaf, const char *tag);
/* Map the pages of the caller's memory [p, p + len) into this process now, in the kernel
 * (MADV_POPULATE_READ, Linux 5.14+; a no-op before), so that a copy into it takes no
 * fault per 4 KiB page. For a bounced load's slot (mpt_batch_load_via): a direct read
 * maps its target inside the kernel as it pins it, a copy traps once per page -- the
 * worker's mapping of the engine's buffer holds only the slots it wrote before. On a
 * shared memory-file mapping the entries it makes are writable; it never changes a
 * byte. */
MPT_INTERNAL int mpt_map_slot(char *p, size_t len);
/* Copy a bounced load's checked block into the caller's slot [dst, dst + len). On x86-64
 * a block of 64 KiB or more goes with streaming (non-temporal) stores, which write the
 * slot's cache lines without reading them from memory first and leave them out of the
 * caches: the slot is cold, and it is read next by the engine, not by this worker. CRC
 * then copy cost 0.13 s of CPU per GB this way against memcpy's 0.17-0.18 on the AMD
 * EPYC of docs/performance.md, section 16. An unaligned slot, a short block or another
 * architecture: memcpy. */
MPT_INTERNAL void mpt_copy_to_slot(char *dst, const char *src, size_t len);
/* One block the system-call way (the loop's step, and io_uring's path for the unusual) */
MPT_INTERNAL int mpt_load_one(struct mpt_batch *b, const char *rel, char *dst, size_t len,
                              int direct);
MPT_INTERNAL int mpt_store_one(struct mpt_batch *b, const char *rel, char *src, size_t len,
                               int direct);
/* One key's lookup the system-call way (block.c), and its answer from what the
 * O_PATH open of it gave (a descriptor, closed here, or -errno): the loop's rules */
MPT_INTERNAL uint8_t mpt_lookup_one(int root, const char *rel, size_t block_bytes,
                                    int flags);
MPT_INTERNAL uint8_t mpt_lookup_opened(int root, const char *rel, int fd,
                                       size_t block_bytes, int flags);
/* uring.c: 0 or -errno with *n_done / *fail_index set as the loop sets them, or
 * MPT_NO_URING (nothing done: run the loop) */
#define MPT_NO_URING 1
MPT_INTERNAL int mpt_uring_batch(int store, struct mpt_batch *b, const char *paths_blob,
                                 size_t n, char *base, const uint64_t *offsets,
                                 size_t block_bytes, size_t *n_done, size_t *fail_index);
/* uring.c: every key's answer in out (0), or MPT_NO_URING (nothing done: run the loop) */
MPT_INTERNAL int mpt_uring_lookup(int root, const char *paths_blob, size_t n,
                                  size_t block_bytes, int flags, uint8_t *out);

#endif
