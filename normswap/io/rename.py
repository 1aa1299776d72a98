"""Renames that never replace what someone else put there, and the fsyncs that make a rename durable.

`rename_new` fails if the destination exists at the moment of the rename (Linux renameat2 RENAME_NOREPLACE;
elsewhere a hard link for files, a check just before for folders). `exchange` swaps two paths in one step
(RENAME_EXCHANGE), so a replaced OUT is the old or the new one at every instant; False where the system or
the file system cannot, and the caller renames twice instead.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import sys
from pathlib import Path

NOREPLACE, EXCHANGE = 1, 2   # renameat2 flags (linux/fs.h)
AT_FDCWD = -100


def _renameat2(src: Path, dst: Path, flag: int) -> bool:
    """renameat2(src, dst, flag): True if done, False where unsupported; OSError (e.g. EEXIST) otherwise."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        call = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).renameat2
    except (OSError, AttributeError):   # a libc older than glibc 2.28, or none
        return False
    call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if call(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flag) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):   # kernel or file system can't
        return False
    raise OSError(err, os.strerror(err), str(dst))


def rename_new(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`; FileExistsError if `dst` exists (a file, folder or symlink), which is left alone."""
    if _renameat2(src, dst, NOREPLACE):
        return
    if os.path.isfile(src) and not os.path.islink(src):
        os.link(src, dst)   # atomic: fails if dst exists
        os.unlink(src)
        return
    if os.path.lexists(dst):   # no atomic way here: checked just before
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


def exchange(a: Path, b: Path) -> bool:
    """Swap the paths `a` and `b` atomically (both must exist); False where the system cannot."""
    return _renameat2(a, b, EXCHANGE)


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a folder's entries, to disk (a no-op where folders cannot be opened)."""
    with contextlib.suppress(OSError):   # Windows opens no folders; some file systems refuse fsync
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) * os.path.isdir(path))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file under the folder `path`, then the folders, deepest first (what git and safetensors
    do before they trust a rename)."""
    for root, _, files in os.walk(path, topdown=False):
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                fsync_path(Path(root) / name)
        fsync_path(Path(root))
