"""Builds the optional native helper of kvcacheio (host byte-range copies without the GIL).

Metadata lives in pyproject.toml. The extension is optional: without a C compiler the install
still succeeds and ``kvcacheio/direct.py`` uses its torch paths (it logs which one runs).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sglang.srt.mem_cache.kvcacheio._native",
            sources=["sglang/srt/mem_cache/kvcacheio/csrc/native_copy.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
