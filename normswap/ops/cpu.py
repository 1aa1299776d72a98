"""The fused CPU RMSNorm: a C++ op built at install time (setup.py) or else at first use, cached; its fallback.

`extension()` returns the compiled module (entry points `rms_norm`, `rms_norm_add`; ops
`torch.ops.normswap.cpu_*`), or None where it cannot be built: then the PyTorch path runs, and normswap says
so, with why, once per machine and build key (not in every command). Nothing is compiled or imported from
here until the first CPU norm call.

`pip install --no-build-isolation` (what `make` runs) builds it beside these sources, as
`normswap.ops._cpu_<build key>`, with the same flags. Otherwise (an isolated build had no torch, or torch
changed since) the first call builds it, with a C++ compiler and ninja (`pip install ninja`): about a
minute once per machine, torch version and source version, cached under $NORMSWAP_CACHE_DIR (default
~/.cache/normswap). The ISA flags follow the vector level ATen itself chose on this CPU
(`torch.backends.cpu.get_cpu_capability()`), which is part of the cache key: never -march=native,
whose binary could hit an illegal instruction on another CPU sharing the cache (a network home).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import warnings
from pathlib import Path

import torch

from normswap.errors import first_line
from normswap.ops import fakes

SOURCES = ("cpu_kernels.cpp", "cpu_bindings.cpp")
# The extensions ATen's own AVX512/AVX2 kernels are built for (AVX512: -mavx512f/bw/vl/dq -mfma, as in
# torch's cmake), so at::vec picks the same vector width; plus F16C for fp16 conversions (every AVX2 CPU
# has it; at::vec's AVX2 half conversions use it).
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
# -fopenmp: at::parallel_for is inline OpenMP; libgomp resolves to torch's own copy (same soname).
BASE_FLAGS = ["-O3", "-fopenmp", "-fvisibility=hidden"]


def cache_dir() -> Path:
    root = os.environ.get("NORMSWAP_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "normswap")
    return Path(root)


def build_flags() -> list[str]:
    cap = torch.backends.cpu.get_cpu_capability()
    level = cap if cap in ISA_FLAGS and platform.machine().lower() in ("x86_64", "amd64") else "DEFAULT"
    return BASE_FLAGS + [f"-DCPU_CAPABILITY={level}", f"-DCPU_CAPABILITY_{level}"] + ISA_FLAGS.get(level, [])


def build_key(flags: list[str]) -> str:
    """What the binary depends on: sources, torch, Python ABI, machine, flags (ISA level included)."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for name in SOURCES:
        h.update((here / name).read_bytes())
    for part in (torch.__version__, torch.version.git_version, sys.implementation.cache_tag, platform.machine(),
                 os.environ.get("CXX", ""), " ".join(flags)):
        h.update(str(part).encode() + b"\0")
    return h.hexdigest()[:16]


def installed_name(flags: list[str]) -> str:
    """The name of the module `setup.py` builds at install time for these flags (and sources, torch)."""
    return f"_cpu_{build_key(flags)}"


def installed(flags: list[str]):
    """The extension built at install time for exactly this build key, imported; None where there is none
    (installed without torch in the build environment, or built for other sources, torch or flags)."""
    name = f"{__package__}.{installed_name(flags)}"
    if importlib.util.find_spec(name) is None:
        return None
    return importlib.import_module(name)


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive lock across processes, released by the OS if the holder dies (no stale locks)."""
    try:
        import fcntl
    except ImportError:  # Windows: torch's own build baton still serialises the compile
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _import(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def build() -> object:
    """Build (or find in the cache) and import the extension; raises with the reason where it cannot."""
    flags = build_flags()
    key = build_key(flags)
    name = f"normswap_cpu_{key}"
    where = cache_dir() / f"cpu-{key}"
    so = where / (name + (".pyd" if sys.platform == "win32" else ".so"))
    done, failed = where / "built", where / "failed"
    if name in sys.modules:
        return sys.modules[name]
    built = installed(flags)
    if built is not None:
        return built
    if not done.exists():
        if failed.exists():  # a compile error is not retried in every process: delete the folder to retry
            raise RuntimeError(f"an earlier build failed, log: {failed}; delete it to retry")
        missing = [tool for tool in ("ninja", os.environ.get("CXX", "c++")) if shutil.which(tool) is None]
        if missing:
            raise RuntimeError(f"{' and '.join(missing)} not found (a C++ compiler and `pip install ninja`)")
        where.mkdir(parents=True, exist_ok=True)
        with _file_lock(where / "normswap.lock"):
            if not done.exists():
                module = _compile(name, where, flags, failed)
                done.touch()
                return module
    return _import(name, so)


def _compile(name: str, where: Path, flags: list[str], failed: Path):
    from torch.utils import cpp_extension

    if sys.stderr.isatty():  # someone is watching: say why the first run pauses
        print("normswap: building the fast CPU RMSNorm (once per machine and version, about a minute)",
              file=sys.stderr, flush=True)
    # A build killed midway leaves torch's own lock file behind; we hold the real lock, so drop it.
    (where / "lock").unlink(missing_ok=True)
    here = Path(__file__).parent
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # compiler-version notices: the outcome is what matters
            return cpp_extension.load(name, [str(here / s) for s in SOURCES], extra_cflags=flags,
                                      extra_ldflags=["-fopenmp"], build_directory=str(where), verbose=False)
    except Exception as e:
        failed.write_text(f"{type(e).__name__}: {e}\n")
        raise RuntimeError(f"the build failed, log: {failed}") from e


@functools.cache
def extension():
    """The compiled module, or None (after one warning) where it cannot be built or loaded."""
    try:
        module = build()
    except Exception as e:  # noqa: BLE001 - any failure means "use the PyTorch path"
        if _first_notice():
            first = first_line(e, type(e).__name__, strip=True)
            warnings.warn(f"normswap: the fast CPU RMSNorm is unavailable ({first}); "
                          "using the slower PyTorch path", RuntimeWarning, stacklevel=2)
        return None
    _register_fakes()
    return module


def _first_notice() -> bool:
    """Whether this machine has not yet been told that the kernel is unavailable for this build key: the
    warning comes once, not in every command (a marker in the cache; every time where it cannot be written)."""
    marker = cache_dir() / f"cpu-{build_key(build_flags())}" / "told"
    if marker.exists():
        return False
    with contextlib.suppress(OSError):
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    return True


def _register_fakes() -> None:
    """Shape-only implementations, so torch.compile and torch.export can trace through the ops."""
    torch.library.register_fake("normswap::cpu_rms_norm", fakes.forward)
    torch.library.register_fake("normswap::cpu_rms_norm_add", fakes.forward_add)
    torch.library.register_fake("normswap::cpu_rms_norm_backward", fakes.backward)
