"""Safe output: refuse dangerous OUTs, write folders atomically, recover from killed runs.

atomic_dir, under an flock on `.OUT.lock` (never a symlink): build `.OUT.tmp-PID-HEX`, fsync it, check
again that OUT may be replaced, then exchange it with OUT in one step (Linux renameat2; OUT is old or new at
every instant) and delete the old from the temp name; where the system cannot exchange, rename OUT ->
`.OUT.old-PID`, the temp folder -> OUT, delete the old. A failure between the two renames puts the old
back; a run killed there leaves `.OUT.old-PID`, which the next run restores (no OUT) or deletes
(the new OUT is in place), and its `.OUT.tmp-PID-HEX`, which the next run deletes. An OUT absent at the
check is renamed into place only if still absent (`rename.rename_new`). atomic_files does the same for an
ONNX file and its external data.

Which leftovers are ours is never judged by name alone (a user's `.OUT.old-mybackup` is theirs): the
lock file is a journal. Before creating a temp or old folder, the writer appends its name to
`.OUT.lock`; a run killed outright leaves that file behind, and the next writer, holding the same
lock, reads it before anything else and touches only the folders listed there whose names have the
exact form normswap generates. A folder no journal lists is left alone, whatever its name.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import os
import re
import secrets
import shutil
import stat
import sys
from pathlib import Path

from normswap import signals
from normswap.errors import Interrupted, NormswapError
from normswap.io import owned, rename
from normswap.io.bundled import DEMO_DIR, DEMO_NAME

try:
    import fcntl
except ImportError:  # Windows: an O_EXCL lock file instead
    fcntl = None

ANY = "any"
NAME_MAX = 255   # bytes in one file name (Linux, macOS, Windows)
_SIDE = 22       # the longest suffix a sidecar adds to the stem: "." + ".tmp-" + 7-digit pid + "-" + 8 hex


def _stem(out: Path) -> str:
    """OUT's name in its sidecars (`.STEM.lock`, `.STEM.tmp-*`, `.STEM.old-*`): the name itself, or for a
    name too long to take a suffix, a prefix of it and a hash of the whole (still unique per OUT)."""
    raw = os.fsencode(out.name)
    if len(raw) + _SIDE <= NAME_MAX:
        return out.name
    digest = hashlib.sha1(raw).hexdigest()[:8]
    return os.fsdecode(raw[:NAME_MAX - _SIDE - 9]).rstrip("\udcff") + "~" + digest


def _note(msg: str) -> None:
    print(f"normswap: {msg}", file=sys.stderr)


def check_output(out, inputs=()) -> Path:
    """Refuse an empty OUT, the current folder or a parent of it, and an OUT holding an input or inside one
    (real paths compared: symlinks followed).

    inputs: (what, path) pairs, e.g. ("SRC", src); missing paths (Hub ids) are skipped.
    """
    if not str(out).strip():
        raise NormswapError("the output path is empty: name a new folder")
    if len(os.fsencode(Path(out).expanduser().name)) > NAME_MAX:
        raise NormswapError(f"the name of {out} is too long: the file system allows {NAME_MAX} bytes")
    target = Path(out).expanduser().resolve()
    with contextlib.suppress(OSError):
        cwd = Path.cwd().resolve()
        if target == cwd or target in cwd.parents:
            raise NormswapError(f"{out} is the current folder or one of its parents: name a new folder")
    for what, src in inputs:
        path = DEMO_DIR if src == DEMO_NAME else Path(src).expanduser() if src else None
        if path is None or not path.exists():
            continue
        for real in _real_paths(path):
            if real == target or target in real.parents:
                raise NormswapError(f"{out} would replace {what} {src}" + (
                    "" if real == path.resolve() else " (symlinks in it point there)") + ": write somewhere else")
        if path.resolve() in target.parents:   # e.g. through a symlink to it: writing there changes the input
            raise NormswapError(f"{out} is inside {what} {src}" + ("" if Path(os.path.abspath(
                Path(out).expanduser())).is_relative_to(os.path.abspath(path)) else " (through a symlink)") +
                ": write somewhere else")
    check_writable(out)
    return target


def check_writable(out) -> None:
    """Refuse an output that cannot be made where it is named, before any work: the nearest existing folder on
    its way (its parent, or the first one that exists) must be a folder in which something can be created.
    Probed by making and removing a hidden folder there: permission bits say nothing to root, nor about
    read-only mounts."""
    path = Path(os.path.abspath(Path(out).expanduser()))
    there = next(p for p in path.parents if p.exists() or p.is_symlink())
    if not there.is_dir():
        raise NormswapError(f"cannot write to {there}: not a folder")
    probe = there / f".normswap-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.mkdir(probe, 0o700)
        os.rmdir(probe)
    except OSError as e:
        raise NormswapError(f"cannot write to {there}: {e.strerror or e}") from None


def _real_paths(path: Path, limit: int = 10_000) -> list[Path]:
    """Where `path`'s data lives: the path resolved, and for a folder the targets of the symlinks in it (a Hub
    cache snapshot's files point into `blobs/`), so that an OUT there is seen to replace the input."""
    found = [path.resolve()]
    if path.is_dir():
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                entry = Path(root) / name
                if entry.is_symlink():
                    found.append(entry.resolve())
            if len(found) > limit:
                break
    return found


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


def _open_lock(out: Path, path: Path) -> int:
    """Open (or create) the lock file `path`, never through a symlink and only as a plain file."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | (0 if fcntl else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o644)
    except FileExistsError:
        raise NormswapError(f"{out} is being written by another normswap (or remove {path})") from None
    except OSError as e:
        if e.errno == errno.ELOOP:   # a symlink: writing through it would change the file it points to
            raise NormswapError(f"{path} is a symlink, not normswap's lock file: remove it") from None
        raise NormswapError(f"cannot write to {out.parent}: {e.strerror or e}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NormswapError(f"{path} is not a file, not normswap's lock file: remove it")
    return fd


@contextlib.contextmanager
def _lock(out: Path):
    """Hold `.OUT.lock` or fail at once: one writer per OUT; a dead writer's lock is free. Yields the file
    descriptor (its content: our pid, then the journal) and what a killed holder's journal listed."""
    path = out.parent / f".{_stem(out)}.lock"
    while True:
        fd = _open_lock(out, path)
        try:
            if fcntl:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = (os.read(fd, 32).decode(errors="replace").split() or ["?"])[0]
            os.close(fd)
            raise NormswapError(f"{out} is being written by another normswap process (pid {holder}): "
                                "try again when it ends") from None
        except OSError as e:  # a file system without locks (some network mounts)
            os.close(fd)
            raise NormswapError(f"cannot lock {path}: {e.strerror or e}") from None
        try:  # the holder before us may have unlinked the file we locked: lock the current one
            if os.path.samestat(os.fstat(fd), os.lstat(path)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        left = os.read(fd, 1 << 16).decode(errors="replace").splitlines()[1:]
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)   # our pid, then the killed run's list again until `recover` has dealt with it
        os.write(fd, "".join(f"{line}\n" for line in [str(os.getpid()), *left]).encode())
        yield fd, [line.partition(" ")[::2] for line in left]
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # before closing: nobody can lock this inode and believe it current
        os.close(fd)


def _journal(fd: int, kind: str, path: Path) -> Path:
    """Record in the lock file, before creating it, that `path` is ours (see the module docstring)."""
    os.write(fd, f"{kind} {path.name}\n".encode())
    return path


def _leftovers(out: Path, kind: str, journal: list[tuple[str, str]]) -> list[Path]:
    """The `kind` folders a killed run's journal lists that exist and have the exact form we generate."""
    form = {"tmp": r"\d+-[0-9a-f]{8}", "old": r"\d+"}[kind]
    pattern = re.compile(rf"\.{re.escape(_stem(out))}\.{kind}-{form}")
    found = [out.parent / n for k, n in journal if k == kind and pattern.fullmatch(n)]
    found = [p for p in dict.fromkeys(found) if p.exists() or p.is_symlink()]
    return sorted(found, key=lambda p: p.lstat().st_mtime)


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def recover(out: Path, journal: list[tuple[str, str]]) -> None:
    """Clean up after a killed run (call under the lock, with the journal it left): restore a lost OUT,
    delete its temp folder. Nothing the journal does not list is touched."""
    for tmp in _leftovers(out, "tmp", journal):
        _remove(tmp)
    olds = _leftovers(out, "old", journal)
    if olds and not (out.exists() or out.is_symlink()):
        old = olds.pop()
        os.rename(old, out)
        _note(f"restored {out} from {old.name}, left by an interrupted run")
    for old in olds:
        _remove(old)


def _swap(tmp: Path, out: Path, fd: int, check) -> None:
    """Put `tmp` in place of `out` once `check()` (OUT may be replaced) holds again at this moment; a signal
    held during the swap is delivered after it as `Interrupted` naming `out`, which is then complete.

    `tmp` and the folder are fsynced first. An existing OUT is exchanged with `tmp` in one step where the
    system can (OUT is the old or the new folder at every instant; the old one is then deleted from the
    journaled temp name), else renamed aside first (`.OUT.old-PID`, journaled). An OUT that appears
    meanwhile is never replaced (`rename.rename_new`)."""
    old, swapped = None, False
    try:
        with signals.deferred():   # SIGINT/SIGTERM held during the swap, then delivered
            rename.fsync_tree(tmp)
            present = out.exists() or out.is_symlink()
            check()   # again, now: someone may have created or replaced OUT while we worked
            if not present:   # and if it appears after the check, the rename fails
                _rename_new(tmp, out)
            elif rename.exchange(tmp, out):
                old = tmp
            else:
                old = _two_renames(tmp, out, fd)
            swapped = True
            rename.fsync_path(out.parent)   # the rename is on disk before the old folder goes
            if old is not None:
                _remove(old)
    except KeyboardInterrupt as e:
        if not swapped:
            raise
        raise Interrupted.after(e, str(out)) from None


def _rename_new(tmp: Path, out: Path) -> None:
    try:
        rename.rename_new(tmp, out)
    except FileExistsError:
        raise NormswapError(f"{out} appeared while normswap ran: it was left as it is, nothing written") from None


def _two_renames(tmp: Path, out: Path, fd: int) -> Path:
    """OUT aside to `.OUT.old-PID` (journaled), `tmp` in its place; the old one back if the second fails."""
    old = out.parent / f".{_stem(out)}.old-{os.getpid()}"
    if old.exists() or old.is_symlink():   # not ours (no journal listed it): never overwritten
        raise NormswapError(f"{old} is in the way: move it, then run again")
    os.rename(out, _journal(fd, "old", old))
    try:
        _rename_new(tmp, out)
    except BaseException as e:
        try:
            rename.rename_new(old, out)
        except OSError as again:
            raise NormswapError(f"could not replace {out} ({e}) nor put it back ({again.strerror}): "
                                f"the old one is in {old}") from None
        raise
    return old


def _honour_umask(path: Path) -> None:
    """The temp folder is made 0700 (private while written): give the output the mode mkdir would (0755
    under umask 022)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o777 & ~mask)


@dataclasses.dataclass(frozen=True)
class Held:
    """OUT's lock, taken ahead of the work that ends in writing OUT (`held`): `out` (absolute), the lock file's
    descriptor and what a killed holder's journal listed."""
    out: Path
    fd: int
    journal: list


def _placed(out: str | Path) -> Path:
    """OUT as an absolute path, checked (`check_output`), its parent made."""
    check_output(out)
    out = Path(os.path.abspath(Path(out).expanduser()))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NormswapError(f"cannot write to {out.parent}: {e.strerror or e}") from None
    return out


@contextlib.contextmanager
def held(out: str | Path):
    """Hold OUT's lock for a block (a heal's training, then its save): a second writer of OUT fails at once
    instead of after its own work. Pass the `Held` it yields to `atomic_dir(..., lock=)` to write OUT under it."""
    out = _placed(out)
    with _lock(out) as (fd, journal):
        yield Held(out, fd, journal)


@contextlib.contextmanager
def _staging(out: str | Path, check, lock: Held | None = None):
    """Under OUT's lock (`lock`, held by the caller, or taken here), after recovering a killed run and
    `check()`: yield (temp folder beside OUT, OUT as an absolute path, the lock's fd); the temp folder is
    deleted if the block fails."""
    out = _placed(out)
    if lock is not None and lock.out != out:
        raise ValueError(f"the lock held is {lock.out}'s, not {out}'s")
    with (contextlib.nullcontext((lock.fd, lock.journal)) if lock else _lock(out)) as (fd, journal):
        recover(out, journal)
        check()
        tmp = _journal(fd, "tmp", out.parent / f".{_stem(out)}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(tmp, 0o700)
        except OSError as e:
            raise NormswapError(f"cannot write to {out.parent}: {e.strerror or e}") from None
        try:
            yield tmp, out, fd
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


@contextlib.contextmanager
def atomic_dir(out: str | Path, overwrite=False, lock: Held | None = None):
    """Yield a temp folder beside `out`; on success it replaces `out`, on failure `out` is as before.

    overwrite: see check_replaceable (checked at the start and again at the swap). Another process writing
    `out` at the same time: NormswapError. lock: OUT's lock, already held (`held`).
    """
    shown = Path(out).expanduser()
    with _staging(out, lambda: check_replaceable(shown, overwrite), lock) as (tmp, out, fd):
        _honour_umask(tmp)
        yield tmp
        _swap(tmp, out, fd, lambda: check_replaceable(shown, overwrite))


@contextlib.contextmanager
def atomic_files(path: str | Path, check):
    """Yield a temp folder beside the file `path`, under the same lock as a folder OUT; its files then move
    beside `path` (`path`'s own name last), once `check()` (they may be written there) holds again. A file
    that appears meanwhile is never replaced. A killed run's temp folder is deleted by the next run."""
    with _staging(path, check) as (tmp, path, fd):
        yield tmp
        moved, created = [], []
        try:
            with signals.deferred():
                rename.fsync_tree(tmp)
                check()
                for f in sorted(tmp.iterdir(), key=lambda f: f.name == path.name):
                    dest = path.parent / f.name
                    if dest.exists() or dest.is_symlink():   # check() allowed it: overwrite
                        os.replace(f, dest)
                    else:
                        _rename_new(f, dest)
                        created.append(dest)
                    moved.append(dest)
                rename.fsync_path(path.parent)
            shutil.rmtree(tmp, ignore_errors=True)
        except KeyboardInterrupt as e:
            if path not in moved:
                raise
            raise Interrupted.after(e, str(path)) from None
        except BaseException:
            if path not in moved:   # without its graph, an external-data file we created is nobody's
                for dest in created:
                    dest.unlink(missing_ok=True)
            raise
