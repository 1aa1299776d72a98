"""Issue 33 (21): `--data` that is not a regular file (/dev/zero, a pipe) is refused at once, not read until
memory runs out; a binary file is refused from its first bytes."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from normswap import textdata
from normswap.errors import NormswapError


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_a_device_is_refused_as_data():
    with pytest.raises(NormswapError, match="^/dev/zero is not a regular file: pass plain text files$"):
        textdata.read_texts(["/dev/zero"])


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes")
def test_a_pipe_nobody_writes_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "normswap", "eval", "normswap-demo", "--data", str(fifo)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1 and done.stderr.strip() == f"error: {fifo} is not a regular file: pass plain text files"


def test_a_binary_file_is_refused_from_its_start(tmp_path, monkeypatch):
    data = tmp_path / "weights.bin"
    data.write_bytes(b"\x00\x01" * (1 << 20))
    monkeypatch.setattr(type(data), "read_text", lambda *a, **k: pytest.fail("read whole"))
    with pytest.raises(NormswapError, match="is not text"):
        textdata.read_texts([data])
