"""Builds the fused CPU RMSNorm (normswap/ops/cpu_*.cpp) at install time, the way PyTorch extension packages
do, where torch can be imported while installing (`pip install --no-build-isolation`, as `make` runs it) and a
C++ compiler is present. Elsewhere normswap installs without it and builds it once, at first use, into its
cache (`normswap.ops.cpu`). Everything else about the package is in pyproject.toml."""
import os
import shutil
import sys

from setuptools import setup


def extension() -> dict:
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:   # an isolated build environment: no torch to build against
        return {}
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return {}
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from normswap.ops.cpu import SOURCES, build_flags, installed_name

    flags = build_flags()
    # The build key (sources, torch, flags) is in the module's name: a stale binary is never imported.
    ext = CppExtension(f"normswap.ops.{installed_name(flags)}", [f"normswap/ops/{s}" for s in SOURCES],
                       extra_compile_args=flags, extra_link_args=["-fopenmp"])
    return {"ext_modules": [ext],
            "cmdclass": {"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)}}


setup(**extension())
