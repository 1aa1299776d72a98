"""The bundled demo model: its name as a source, and its folder (package data)."""
from __future__ import annotations

from pathlib import Path

DEMO_NAME = "normswap-demo"
DEMO_DIR = Path(__file__).parent.parent / "demo"   # normswap/demo: package data
