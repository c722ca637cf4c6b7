"""cffi build script of the native core: declares the interface, nothing else.

setup.py hands it to cffi (``cffi_modules=["mptier/native/build_ffi.py:ffibuilder"]``),
so ``pip install .`` and ``pip install -e .`` compile ``mptier_io.c`` into the API-mode
extension ``mptier.native._mptier_cffi``. For a quick in-tree build while hacking on
the C file, run ``python mptier/native/build_ffi.py`` from the repository root.
"""

from __future__ import annotations

import os

from cffi import FFI

MODULE_NAME = "mptier.native._mptier_cffi"
C_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mptier_io.c")

ffibuilder = FFI()

ffibuilder.cdef(
    """
    #define MPT_O_DIRECT ...
    #define MPT_DIRECT_ALIGN ...

    int mpt_batch_store(const char *paths_blob, size_t n, char *base,
                        const uint64_t *offsets, size_t block_bytes, int flags,
                        size_t *n_done, size_t *fail_index);
    int mpt_batch_load(const char *paths_blob, size_t n, char *base,
                       const uint64_t *offsets, size_t block_bytes, int flags,
                       size_t *n_done, size_t *fail_index);
    int mpt_batch_exists(const char *paths_blob, size_t n, uint8_t *out);
    int mpt_probe_o_direct(const char *dir);
    """
)

with open(C_SOURCE, encoding="utf-8") as _f:
    # The whole core is one translation unit, pasted after cffi's own prelude.
    ffibuilder.set_source(MODULE_NAME, _f.read())

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
