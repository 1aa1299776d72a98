"""The rotation matrices: Hadamard (Sylvester times Paley) and random orthogonal, orthogonal and seeded."""
import math

import pytest
import torch

from normswap.surgery.orthogonal import hadamard, random_orthogonal, rotation

I64 = dict(dtype=torch.float64)


@pytest.mark.parametrize("n", [1, 2, 4, 12, 20, 24, 32, 48, 96, 768])
def test_hadamard_is_orthogonal_with_entries_of_one_size(n):
    h = hadamard(n)
    assert h.shape == (n, n)
    assert torch.allclose(h @ h.T, torch.eye(n, **I64), atol=1e-12)
    assert torch.allclose(h.abs(), torch.full((n, n), 1 / math.sqrt(n), **I64))


@pytest.mark.parametrize("n", [3, 6, 10, 36])
def test_no_hadamard_where_none_is_known(n):
    assert hadamard(n) is None


def test_random_orthogonal_is_orthogonal_and_seeded():
    a = random_orthogonal(30, torch.Generator().manual_seed(0))
    assert torch.allclose(a @ a.T, torch.eye(30, **I64), atol=1e-12)
    assert torch.equal(a, random_orthogonal(30, torch.Generator().manual_seed(0)))
    assert not torch.allclose(a, random_orthogonal(30, torch.Generator().manual_seed(1)))


def test_rotation_randomises_the_hadamard_signs_per_seed_and_falls_back_where_none_is_known():
    q0, what = rotation(64, "hadamard", 0)
    assert what == "randomised Hadamard" and torch.allclose(q0 @ q0.T, torch.eye(64, **I64), atol=1e-12)
    assert torch.equal(q0, rotation(64, "hadamard", 0)[0]) and not torch.equal(q0, rotation(64, "hadamard", 1)[0])
    assert torch.equal(q0.abs(), hadamard(64).abs())
    q, what = rotation(36, "hadamard", 0)
    assert what.startswith("random orthogonal") and torch.allclose(q @ q.T, torch.eye(36, **I64), atol=1e-12)
    assert rotation(64, "random", 0)[1] == "random orthogonal"
    with pytest.raises(ValueError):
        rotation(8, "givens", 0)
