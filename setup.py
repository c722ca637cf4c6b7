"""setuptools needs this file only to hand cffi the build script of the native core.

Everything else about the package lives in pyproject.toml.
"""

from setuptools import setup

setup(cffi_modules=["mptier/native/build_ffi.py:ffibuilder"])
