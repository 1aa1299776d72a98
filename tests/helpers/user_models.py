"""Models written by hand, not by transformers (no config): what a user converts with `example_inputs`."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), nn.MultiheadAttention(d, 2, batch_first=True)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's shape: token and position embeddings, pre-LN blocks, a final norm, an untied head;
    `prefix` (optional) adds projected features to the first position only when given."""

    def __init__(self, vocab: int = 61, d: int = 32, layers: int = 2, block_size: int = 64):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.prefix = nn.Linear(8, d)

    def forward(self, idx, prefix=None):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        if prefix is not None:
            x = torch.cat([x[:, :1] + self.prefix(prefix)[:, None], x[:, 1:]], 1)
        mask = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), 1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def perturbed(model: nn.Module, seed: int = 0) -> nn.Module:
    """`model` with its LayerNorm gains and biases drawn away from 1 and 0 (as a trained model's are), in eval."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.3 * torch.randn(m.bias.shape, generator=g))
    return model.eval()


def gpt(seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    return perturbed(GPT(**kw), seed)
