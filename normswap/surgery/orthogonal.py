"""The orthogonal matrices a rotation uses, in float64, seeded.

- `hadamard(n)`: a Hadamard matrix scaled to be orthogonal (H Hᵀ = I): Sylvester's construction for a
  power of two, times a Paley (type I) one of order q + 1 for a prime q ≡ 3 (mod 4) (12, 20, 24, 44, ...):
  768 = 64·12 and 2560 = 128·20 are covered; None where n is neither (`hadamard_factors`: the two factors).
- `random_orthogonal(n, g)`: Q of the QR of a Gaussian matrix, signs fixed so that it is Haar-distributed.
- `rotation(n, method, seed)`: "hadamard" (a randomised Hadamard D·H, D a random ±1 diagonal; a random
  orthogonal matrix where no Hadamard of that order is known) or "random".
- `online_factors(n, method, g)`: the same, as the factors an online rotation applies (`fixes.online_rotated`).
"""
from __future__ import annotations

import math
from typing import get_args

import torch

from normswap.choices import Rotation

METHODS = get_args(Rotation)   # the orthogonal matrices `rotation` builds


def _prime(q: int) -> bool:
    return q > 1 and all(q % d for d in range(2, math.isqrt(q) + 1))


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _paley(q: int) -> torch.Tensor:
    """A Hadamard matrix of order q + 1 (Paley I), q a prime ≡ 3 (mod 4)."""
    squares = {i * i % q for i in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if i in squares else -1.0 for i in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    jacobsthal = chi[(idx[None, :] - idx[:, None]) % q]   # Q[i, j] = chi(j - i), antisymmetric
    s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, jacobsthal
    return s + torch.eye(q + 1, dtype=torch.float64)


def hadamard_factors(n: int) -> tuple[int, torch.Tensor] | None:
    """(p, F): an unscaled Hadamard matrix of order n is Sylvester's of order p (the largest power of two for which
    one is known) ⊗ F (entries ±1, order n / p: 1 or a Paley matrix); None where no construction here gives one."""
    if n < 1:
        return None
    two = n & -n   # the largest power of two dividing n
    for k in range(two.bit_length() - 1, -1, -1):
        m = n >> k
        if m == 1:
            return n, torch.ones(1, 1, dtype=torch.float64)
        if m % 4 == 0 and (m - 1) % 4 == 3 and _prime(m - 1):
            return 1 << k, _paley(m - 1)
    return None


def hadamard(n: int) -> torch.Tensor | None:
    """An orthogonal n x n matrix with entries ±1/sqrt(n), or None where no construction here gives one."""
    found = hadamard_factors(n)
    return None if found is None else torch.kron(_sylvester(found[0]), found[1]) / math.sqrt(n)


def random_orthogonal(n: int, g: torch.Generator) -> torch.Tensor:
    """A Haar-random orthogonal n x n matrix (QR of a Gaussian, the signs of R's diagonal moved into Q)."""
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)).masked_fill(torch.diagonal(r) == 0, 1.0)[None, :]


def times(t: torch.Tensor, dim: int, q: torch.Tensor) -> torch.Tensor:
    """t with its dim `dim` multiplied by q (x -> xQ along that dim), in float64."""
    return (t.double().movedim(dim, -1) @ q.double()).movedim(-1, dim)


def online_factors(n: int, method: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(signs, F, what it is) of an online rotation of width n (`fixes.online_rotated`: H = diag(signs)·(S ⊗ F)
    scaled), drawn from `g`: "hadamard", a randomised Hadamard matrix (random signs, F its ±1 non-power-of-two
    factor: a fast transform); "random", or a width with no known Hadamard matrix, a random orthogonal F (n x n,
    signs ones: a dense matmul)."""
    found = hadamard_factors(n) if method == "hadamard" else None
    if found is None:
        what = "random orthogonal" if method == "random" else f"random orthogonal (no Hadamard of order {n} known)"
        return torch.ones(n, dtype=torch.float64), random_orthogonal(n, g), f"{what}, dense {n} x {n}"
    p, f = found
    signs = torch.randint(0, 2, (n,), generator=g, dtype=torch.float64) * 2 - 1
    return signs, f, f"randomised Hadamard, fast transform {p}" + (f" x {f.shape[0]}" if f.shape[0] > 1 else "")


def rotation(n: int, method: str, seed: int) -> tuple[torch.Tensor, str]:
    """(Q, what it is) for a stream of width n: see the module docstring."""
    if method not in METHODS:
        raise ValueError(f"unknown rotation '{method}': choose hadamard or random")
    g = torch.Generator().manual_seed(seed)
    h = hadamard(n) if method == "hadamard" else None
    if h is None:
        what = "random orthogonal" if method == "random" else f"random orthogonal (no Hadamard of order {n} known)"
        return random_orthogonal(n, g), what
    signs = torch.randint(0, 2, (n,), generator=g, dtype=torch.float64) * 2 - 1
    return signs[:, None] * h, "randomised Hadamard"
