"""Safe output: refuse dangerous OUTs, write folders atomically, recover from killed runs.

atomic_dir, under an flock on `.OUT.lock`: build `.OUT.tmp-*`, rename OUT -> `.OUT.old-PID`,
rename the temp folder -> OUT, delete the old. A failure between the two renames puts the old
back; a run killed there leaves `.OUT.old-*`, which the next run restores (no OUT) or deletes
(the new OUT is in place), and its `.OUT.tmp-*`, which the next run deletes.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from normswap import owned
from normswap.errors import Interrupted, NormswapError
from normswap.models.demo import DEMO_DIR, DEMO_NAME

try:
    import fcntl
except ImportError:  # Windows: an O_EXCL lock file instead
    fcntl = None

ANY = "any"


def _note(msg: str) -> None:
    print(f"normswap: {msg}", file=sys.stderr)


def check_output(out, inputs=()) -> Path:
    """Refuse an empty OUT, the current folder or a parent of it, and an OUT holding an input.

    inputs: (what, path) pairs, e.g. ("SRC", src); missing paths (Hub ids) are skipped.
    """
    if not str(out).strip():
        raise NormswapError("the output path is empty: name a new folder")
    target = Path(out).expanduser().resolve()
    with contextlib.suppress(OSError):
        cwd = Path.cwd().resolve()
        if target == cwd or target in cwd.parents:
            raise NormswapError(f"{out} is the current folder or one of its parents: name a new folder")
    for what, src in inputs:
        path = DEMO_DIR if src == DEMO_NAME else Path(src).expanduser() if src else None
        if path is None or not path.exists():
            continue
        path = path.resolve()
        if path == target or target in path.parents:
            raise NormswapError(f"{out} would replace {what} {src}: write somewhere else")
    return target


def check_replaceable(out, overwrite) -> None:
    """Raise unless `out` may be (re)written: absent, or overwrite and it looks like normswap's output.

    overwrite: False, True (replace an empty folder or one normswap wrote), or "any" (any folder).
    """
    out = Path(out).expanduser()
    if not (out.exists() or out.is_symlink()):
        return
    if not overwrite:
        raise NormswapError(f"{out} exists: pass `overwrite=True` to replace it")
    if not out.is_dir():
        raise NormswapError(f"{out} exists and is not a folder")
    if overwrite == ANY:
        return
    reason = owned.foreign(out)
    if reason:
        raise NormswapError(f"{out} {reason}: pass `overwrite='any'` to replace it anyway")


@contextlib.contextmanager
def _lock(out: Path):
    """Hold `.OUT.lock` (with our pid) or fail at once: one writer per OUT; a dead writer's lock is free."""
    path = out.parent / f".{out.name}.lock"
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | (0 if fcntl else os.O_EXCL), 0o644)
        except FileExistsError:
            raise NormswapError(f"{out} is being written by another normswap (or remove {path})") from None
        except OSError as e:
            raise NormswapError(f"cannot write to {out.parent}: {e.strerror or e}") from None
        try:
            if fcntl:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise NormswapError(f"{out} is being written by another normswap process (pid {holder}): "
                                "try again when it ends") from None
        except OSError as e:  # a file system without locks (some network mounts)
            os.close(fd)
            raise NormswapError(f"cannot lock {path}: {e.strerror or e}") from None
        try:  # the holder before us may have unlinked the file we locked: lock the current one
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # before closing: nobody can lock this inode and believe it current
        os.close(fd)


def _leftovers(out: Path, kind: str) -> list[Path]:
    pattern = re.compile(rf"\.{re.escape(out.name)}\.{kind}-[A-Za-z0-9_]+")
    found = [p for p in out.parent.iterdir() if pattern.fullmatch(p.name)]
    return sorted(found, key=lambda p: p.lstat().st_mtime)


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def recover(out: Path) -> None:
    """Clean up after killed runs (call under the lock): restore a lost OUT, delete stale temp folders."""
    for tmp in _leftovers(out, "tmp"):
        _remove(tmp)
    olds = _leftovers(out, "old")
    if olds and not (out.exists() or out.is_symlink()):
        old = olds.pop()
        inner = old / "x"  # the layout of normswap <= 0.1.0: .OUT.old-*/x
        legacy = not old.is_symlink() and old.is_dir() and os.listdir(old) == ["x"] and inner.is_dir()
        os.rename(inner if legacy else old, out)
        if legacy:
            _remove(old)
        _note(f"restored {out} from {old.name}, left by an interrupted run")
    for old in olds:
        _remove(old)


@contextlib.contextmanager
def _signals_deferred():
    """Hold SIGINT/SIGTERM during the swap, then deliver the first one to the handlers restored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {s: signal.signal(s, lambda n, f: got.append(n)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        if got:
            signal.raise_signal(got[0])


def _swap(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out` (the old `out` aside, then deleted); a signal held during the swap is delivered
    after it as `Interrupted` naming `out`, which is then complete."""
    old = None
    try:
        with _signals_deferred():
            if out.exists() or out.is_symlink():
                old = out.parent / f".{out.name}.old-{os.getpid()}"
                os.rename(out, old)
                try:
                    os.rename(tmp, out)
                except BaseException as e:
                    try:
                        os.rename(old, out)
                    except OSError as again:
                        raise NormswapError(f"could not replace {out} ({e}) nor put it back ({again.strerror}): "
                                            f"the old one is in {old}") from None
                    raise
            else:
                os.rename(tmp, out)
            if old is not None:
                _remove(old)
    except KeyboardInterrupt as e:
        if not out.exists() or tmp.exists():   # the swap itself did not happen
            raise
        raise Interrupted.after(e, str(out)) from None


def _honour_umask(path: Path) -> None:
    """mkdtemp makes 0700 folders: give the output the mode mkdir would (0755 under umask 022)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o777 & ~mask)


@contextlib.contextmanager
def atomic_dir(out: str | Path, overwrite=False):
    """Yield a temp folder beside `out`; on success it replaces `out`, on failure `out` is as before.

    overwrite: see check_replaceable. Another process writing `out` at the same time: NormswapError.
    """
    check_output(out)
    shown, out = Path(out).expanduser(), Path(os.path.abspath(Path(out).expanduser()))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NormswapError(f"cannot write to {out.parent}: {e.strerror or e}") from None
    with _lock(out):
        recover(out)
        check_replaceable(shown, overwrite)
        try:
            tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
        except OSError as e:
            raise NormswapError(f"cannot write to {out.parent}: {e.strerror or e}") from None
        try:
            _honour_umask(tmp)
            yield tmp
            _swap(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
