"""Fixtures shared by the whole suite; the models and helpers they use live in `helpers/`."""
from __future__ import annotations

import pytest

from helpers.tiny import FAMILIES, tiny_model


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A tiny GPT-2 saved by transformers (an unconverted SRC folder)."""
    path = tmp_path_factory.mktemp("src") / "gpt2"
    tiny_model("gpt2").save_pretrained(path)
    return path
