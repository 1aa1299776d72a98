"""The `normswap` group with every command registered on it."""
from normswap.cli.app import main
from normswap.cli.convert import convert, inspect
from normswap.cli.export import export
from normswap.cli.heal import eval_cmd, heal, plot_cmd

for command in (convert, inspect, heal, eval_cmd, export, plot_cmd):
    main.add_command(command)

__all__ = ["main"]
