"""cffi build script of the native core: declares the interface, nothing else.

setup.py hands it to cffi (``cffi_modules=["mptier/native/build_ffi.py:ffibuilder"]``),
so ``pip install .`` and ``pip install -e .`` compile the C files below into the
API-mode extension ``mptier.native._mptier_cffi``. For a quick in-tree build while
hacking on the C files, run ``python mptier/native/build_ffi.py`` from the repository root.
"""

from __future__ import annotations

import os

from cffi import FFI

MODULE_NAME = "mptier.native._mptier_cffi"
HERE = os.path.dirname(os.path.abspath(__file__))
# The floors of mptier_native.h, the top first.
C_FILES = ["mptier_io.c", "uring.c", "probes.c", "block.c", "direct.c", "fdio.c",
           "resolve.c", "crc32c.c", "encode.c", "queue.c"]

ffibuilder = FFI()

ffibuilder.cdef(
    """
    #define MPT_O_DIRECT ...
    #define MPT_CHECKSUM ...
    #define MPT_TOUCH ...
    #define MPT_TMPFILE ...
    #define MPT_NO_OPENAT2 ...
    #define MPT_URING ...
    #define MPT_WHOLE_BOUNCE ...
    #define MPT_LOOP_LOOKUP ...
    #define MPT_WIRE_VERSION ...
    #define MPT_TASK_RECORD_BYTES ...
    #define MPT_TASK_HEADER_BYTES ...
    #define MPT_TASK_MAX_ITEMS ...
    #define MPT_GROUP_IDX_BYTES ...
    #define MPT_TASK_PATHS_BYTES ...
    #define MPT_LOOKUP_PATHS_BYTES ...
    #define MPT_DIRECT_ALIGN ...
    #define MPT_TAG_LEN ...
    #define MPT_TEMP_SUFFIX_MAX_BYTES ...
    #define MPT_TMPFS_MAGIC ...
    #define MPT_RAMFS_MAGIC ...
    #define MPT_LOOKUP_ABSENT ...
    #define MPT_LOOKUP_PRESENT ...
    #define MPT_LOOKUP_SYMLINK ...
    #define MPT_LOOKUP_BAD ...
    #define MPT_LOOKUP_SHORT ...
    #define MPT_CRC32C_BEST ...
    #define MPT_CRC32C_TABLE ...
    #define MPT_CRC32C_HW ...
    #define MPT_CRC32C_AVX512 ...
    #define MPT_CRC32C_AVX2 ...
    #define MPT_CRC32C_PCLMUL ...

    int mpt_batch_store(int root, const char *paths_blob, size_t n, char *base,
                        size_t base_len, const uint64_t *offsets, size_t block_bytes,
                        int flags, const char *tag, size_t *n_done, size_t *fail_index,
                        int *tmp_unlink_errno, uint8_t *found);
    int mpt_batch_store_via(int root, const char *paths_blob, size_t n, char *base,
                            size_t base_len, const uint64_t *offsets, size_t block_bytes,
                            int flags, const char *tag, char *bounce, size_t bounce_blocks,
                            size_t *n_done, size_t *fail_index, int *tmp_unlink_errno,
                            uint8_t *found);
    int mpt_batch_load(int root, const char *paths_blob, size_t n, char *base,
                       size_t base_len, const uint64_t *offsets, size_t block_bytes,
                       int flags, size_t *n_done, size_t *fail_index);
    int mpt_batch_load_via(int root, const char *paths_blob, size_t n, char *base,
                           size_t base_len, const uint64_t *offsets, size_t block_bytes,
                           int flags, char *bounce, size_t bounce_blocks, size_t *n_done,
                           size_t *fail_index);
    int mpt_batch_lookup(int root, const char *paths_blob, size_t n, size_t block_bytes,
                         int flags, uint8_t *out);
    int mpt_probe_o_direct(const char *dir);
    int mpt_probe_xattr(const char *dir);
    int mpt_probe_o_tmpfile(const char *dir);
    uint32_t mpt_crc32c(uint32_t crc, const char *p, size_t n, int impl);
    uint32_t mpt_crc32c_copy(uint32_t crc, char *dst, const char *src, size_t n);
    const char *mpt_crc32c_impls(void);
    const char *mpt_crc32c_lacks(const char *name);
    int mpt_crc32c_select(const char *name);
    const char *mpt_crc32c_selected(void);
    const char *mpt_resolver(void);
    const char *mpt_xattr_name(void);
    const char *mpt_uring_status(void);
    int mpt_fs_in_memory(const char *dir);
    int mpt_same_folder(const char *path, uint64_t dev, uint64_t ino);
    int mpt_evict_block(const char *path, uint64_t size, uint64_t ino, int64_t atime_ns,
                        int told);
    int mpt_encode_job(unsigned char *out, size_t out_len, int kind, uint64_t first_task,
                       const unsigned char *keys, size_t key_len, size_t n,
                       const int64_t *ids, size_t per_task);
    int mpt_task_items(const unsigned char *record, size_t record_len, size_t block_bytes,
                       char *paths, size_t paths_len, size_t *paths_used, uint64_t *offsets,
                       size_t max_items);
    int mpt_take_record(const int *fds, size_t n, unsigned char *record, size_t record_len,
                        int *more);
    int mpt_task_load(int root, const unsigned char *record, size_t record_len, char *base,
                      size_t base_len, size_t block_bytes, int flags, char *bounce,
                      size_t bounce_blocks, size_t *n_done, size_t *fail_index);
    """
)

ffibuilder.set_source(
    MODULE_NAME,
    '#include "mptier_native.h"',
    # setuptools wants paths relative to the project (the build's working directory)
    sources=[os.path.relpath(os.path.join(HERE, name)) for name in C_FILES],
    include_dirs=[os.path.relpath(HERE)],
    depends=[os.path.relpath(os.path.join(HERE, "mptier_native.h"))],
    # -O2 whatever the interpreter was built with: the CRC and copy loops want it.
    extra_compile_args=["-O2"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
