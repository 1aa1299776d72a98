"""Converted tiny models for the export tests."""
from __future__ import annotations

import torch

import normswap
from helpers.tiny import tiny_model


def converted(family: str, seed: int = 0):
    model = tiny_model(family, seed)
    normswap.convert(model, method="naive")
    return model


@torch.no_grad()
def talkative(family: str):
    """A converted decoder whose greedy output varies (perturbed tied GPT-2 embeddings repeat one token)."""
    model = converted(family)
    if family == "gpt2":
        g = torch.Generator().manual_seed(1)
        model.transformer.wte.weight.copy_(0.1 * torch.randn(model.transformer.wte.weight.shape, generator=g))
    return model
