"""`normswap generate SRC PROMPT` (`generate_checkpoint`): look at a converted or healed model's text."""
from __future__ import annotations

import json

import click

from normswap.cli.options import Shared, shared
from normswap.pipeline.generate import generate_checkpoint
from normswap.pipeline.options import GenerateOptions


@click.command()
@click.argument("src")
@click.argument("prompt")
@shared(GenerateOptions)
def generate(src, prompt, opts: Shared, options: GenerateOptions):
    """Continue PROMPT with the causal LM SRC (greedy unless --sample) and print the prompt and its continuation."""
    result = generate_checkpoint(src, prompt, options)
    click.echo(json.dumps(result.to_dict()) if opts.as_json else prompt + result.text)
