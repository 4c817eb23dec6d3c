"""Builds the optional native helpers: kvcacheio's host byte-range copies and the L3 backends'
batched file I/O (both without the GIL).

Metadata lives in pyproject.toml. The extension is optional: without a C compiler the install
still succeeds, ``kvcacheio/direct.py`` uses its torch paths and the storage backends their
Python paths (each logs which one runs).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sglang.srt.mem_cache.kvcacheio._native",
            sources=["sglang/srt/mem_cache/kvcacheio/csrc/native_copy.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "sglang.srt.mem_cache.storage._native_files",
            sources=["sglang/srt/mem_cache/storage/csrc/native_files.c"],
            extra_compile_args=["-O2"],
            libraries=["dl"],
            optional=True,
        ),
    ]
)
