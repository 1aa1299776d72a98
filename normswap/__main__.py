"""`python -m normswap`: the CLI (its entry point sets the one-line Ctrl-C hook before the heavy imports)."""
from normswap.cli import run

run()
