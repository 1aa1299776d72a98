"""Running the CLI in-process and checking its one-line error contract; folder snapshots."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager

from click.testing import CliRunner

from normswap.cli import main


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_error_line(result, code=1):
    lines = result.output.strip().splitlines()
    assert result.exit_code == code and len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def snapshot(folder):
    """Every file under `folder`, by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@contextmanager
def another_writer(script: str, target, go):
    """Run `script` (argv: target, go, normswap's folder) in a second process until it has started writing
    `target` and made `go`; yields the process; on exit removes `go` (its signal to finish) and checks that it
    ended cleanly."""
    import normswap
    first = subprocess.Popen([sys.executable, "-c", script, str(target), str(go), os.path.dirname(normswap.__file__)])
    try:
        for _ in range(600):
            if go.exists() or first.poll() is not None:
                break
            time.sleep(0.05)
        assert go.exists(), "the first writer never started"
        yield first
    finally:
        go.unlink(missing_ok=True)
        assert first.wait(60) == 0
