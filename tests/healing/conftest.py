"""The healing tests' tiny pair: a GPT-2 with perturbed LayerNorms (the teacher) and its naive conversion."""
from __future__ import annotations

import copy

import pytest
from helpers.heal_models import gpt2, tokenizer

import normswap


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


@pytest.fixture(scope="module")
def pair(tok):
    """(teacher with perturbed LayerNorms, its naive RMSNorm conversion)."""
    teacher = gpt2(len(tok))
    student = copy.deepcopy(teacher)
    normswap.convert(student, method="naive")
    return teacher, student
