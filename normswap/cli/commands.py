"""The `normswap` commands, by name: the module and function of each, imported only when that command runs
(or help lists it), so `normswap --version` imports neither torch nor transformers."""
COMMANDS = {
    "convert": "normswap.cli.convert:convert", "inspect": "normswap.cli.convert:inspect",
    "heal": "normswap.cli.heal:heal", "eval": "normswap.cli.heal:eval_cmd", "plot": "normswap.cli.heal:plot_cmd",
    "export": "normswap.cli.export:export", "generate": "normswap.cli.generate:generate",
    "rotate": "normswap.cli.rotate:rotate",
}
