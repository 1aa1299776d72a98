"""Hand-written models (no config) whose exact conversion adds structure beyond the norms: a tied head (the
embedding centred at lookup, an output fix), a final norm returned as is (its bias kept after it), and models
returning a tuple or a dict (for export)."""
import torch
from torch import nn

from helpers.user_models import perturbed


class MLPBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        return x + self.fc(self.ln(x))


class TiedLM(nn.Module):
    """Pre-LN blocks over a token embedding that the head shares (tied weights)."""

    def __init__(self, vocab: int = 37, d: int = 16, layers: int = 2):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*(MLPBlock(d) for _ in range(layers)))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        return self.head(self.ln_f(self.blocks(self.wte(idx))))


class Encoder(nn.Module):
    """Pre-LN blocks over float features; returns the final norm's output itself."""

    def __init__(self, d_in: int = 12, d: int = 16, layers: int = 2):
        super().__init__()
        self.proj = nn.Linear(d_in, d)
        self.blocks = nn.Sequential(*(MLPBlock(d) for _ in range(layers)))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(self.blocks(self.proj(x)))


class PairOut(Encoder):
    """Returns a tuple: (features, pooled logits)."""

    def __init__(self, classes: int = 5, **kw):
        super().__init__(**kw)
        self.cls = nn.Linear(self.norm.normalized_shape[0], classes)

    def forward(self, x):
        h = super().forward(x)
        return h, self.cls(h.mean(1))


class DictOut(PairOut):
    """Returns a nested dict: {"features": ..., "heads": {"logits": ..., "probs": ...}}."""

    def forward(self, x, scale=None):
        h, logits = super().forward(x if scale is None else x * scale)
        return {"features": h, "heads": {"logits": logits, "probs": logits.softmax(-1)}}


def built(cls, seed: int = 0, **kw) -> nn.Module:
    """A fresh instance of `cls` (its own initialisation for `seed`), LayerNorms perturbed, in eval."""
    torch.manual_seed(seed)
    return perturbed(cls(**kw), seed)
