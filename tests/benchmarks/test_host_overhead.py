"""benchmarks/host_overhead.py runs anywhere (the launch stubbed) and prints its table."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def test_host_overhead_prints_every_row():
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_overhead.py"), "--calls", "50"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1:3] for line in proc.stdout.splitlines()
            if line.startswith("| ") and "host us" not in line]
    assert len(rows) == 8 and all(float(us) > 0 for _, us in rows), proc.stdout
