"""Each centring-preserving operation, both ways: a toy where the stream stays centred converts exactly (to
1e-5 on inputs other than the traced ones), and one where the operation really changes the mean is refused,
naming the operation and the norm."""
from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_outputs import CausalLMOutput

import normswap
from normswap.errors import NormswapError
from normswap.parity import compare
from normswap.surgery.walk import Skip
from helpers.exact_models import perturb

V, D, H = 50, 16, 4
G = torch.Generator().manual_seed(7)


def ids(b: int = 2, n: int = 8) -> dict:
    return {"input_ids": torch.randint(0, V, (b, n), generator=G)}


class Toy(nn.Module):
    """Embedding -> `block` (the operation under test) -> final norm -> head."""

    def __init__(self, width: int = D):
        super().__init__()
        self.config = PretrainedConfig()
        self.emb, self.ln_f, self.head = nn.Embedding(V, D), nn.LayerNorm(width), nn.Linear(width, V)
        self.ln = nn.LayerNorm(D)

    def forward(self, input_ids):
        return CausalLMOutput(logits=self.head(self.ln_f(self.block(self.emb(input_ids)))))


def _exact(model: nn.Module, feed, traced: list[dict], unseen: list[dict]) -> normswap.ConversionReport:
    torch.manual_seed(0)
    model = perturb(model).eval()
    reference = copy.deepcopy(model)
    feed(traced)
    report = normswap.convert(model, method="exact")
    assert report.method == "exact"
    assert compare(reference, model, unseen).max_rel <= 1e-5
    naive = copy.deepcopy(reference)
    normswap.convert(naive, method="naive")
    assert compare(reference, naive, unseen).max_rel > 1e-3   # the perturbation matters
    return report


def _refused(model: nn.Module, feed, traced: list[dict], *names: str) -> str:
    """The use is not centred: `exact` refuses (the model untouched), or keeps the norm it concerns as a
    LayerNorm while the rest converts exactly; either way the cause is named."""
    torch.manual_seed(0)
    model = perturb(model).eval()
    reference = copy.deepcopy(model)
    feed(traced)
    try:
        report = normswap.convert(model, method="exact")
    except NormswapError as e:
        msg = str(e)
        assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), model.state_dict().values()))
    else:
        kept = [s for s in report.skipped if s.cause is Skip.KEPT]
        assert kept and all(isinstance(model.get_submodule(s.name), nn.LayerNorm) for s in kept), report.skipped
        assert compare(reference, model, traced).max_rel <= 1e-5   # what is converted is exact
        msg = "; ".join(f"{s.name}: {s.reason}" for s in kept)
    assert "\n" not in msg and all(n in msg for n in names), msg
    return msg


# 1. per-channel scaling by a parameter: folded into the layer it scales, like LayerScale
class ParamScale(Toy):
    def __init__(self, scale_stream: bool):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.lambda_1 = nn.Parameter(0.5 + torch.rand(D, generator=G))
        self.scale_stream = scale_stream

    def block(self, x):
        if self.scale_stream:   # scales a sum of two layers (and the embedding): not one layer's output
            return self.lambda_1 * (x + self.fc(self.ln(x)))
        return x + self.lambda_1 * self.fc(self.ln(x))


def test_parameter_scale_is_folded(feed):
    model = ParamScale(False)
    _exact(model, feed, [ids()], [ids(3, 5)])
    assert torch.equal(model.lambda_1, torch.ones(D))   # folded into fc (exact, checked by `_exact`), then set to 1


def test_parameter_scale_of_a_sum_is_refused(feed):
    _refused(ParamScale(True), feed, [ids()], "lambda_1", "ln_f")


# 2. permutations, rolls and window partitions over token dims
class Windows(Toy):
    def __init__(self, mix_positions: bool):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.mix = mix_positions

    def block(self, x):
        b, n, d = x.shape
        x = torch.roll(x, shifts=1, dims=1)
        w = x.view(b, n // 4, 4, d).permute(0, 2, 1, 3).reshape(b * 4, n // 4, d)   # windows
        w = w + self.fc(self.ln(w))
        x = w.view(b, 4, n // 4, d).permute(0, 2, 1, 3).reshape(b, n, d).flip(1)
        if self.mix:   # each channel taken from another position: rows are no longer one token's
            index = (torch.arange(d) % n).expand(b, 1, d).expand(b, n, d)
            x = torch.gather(x, 1, (index + torch.arange(n).view(1, n, 1)) % n)
        return x


def test_rolls_and_windows_keep_the_stream(feed):
    _exact(Windows(False), feed, [ids()], [ids(3, 12)])


def test_a_gather_mixing_positions_per_channel_is_refused(feed):
    _refused(Windows(True), feed, [ids()], "ln_f", "mixes channels of different positions")


# 3. concatenation and splits along tokens keep the stream; along the hidden dim they do not: centring each
# part shifts it by its own mean, and a norm over the whole row (Reformer's final norm over its two
# half-streams, Swin's patch merging over four positions) ignores only a shift that is the same everywhere.
class Halves(Toy):
    def __init__(self, joined: bool):
        super().__init__(2 * D if joined else D)
        self.fc, self.ln2, self.fc2 = nn.Linear(D, D), nn.LayerNorm(D), nn.Linear(D, D)
        self.joined = joined

    def block(self, x):
        x = torch.cat([x, x.flip(1)], dim=1)   # along tokens
        a, b = torch.cat([x, x], dim=-1).chunk(2, dim=-1)   # two half-streams
        a = a + self.fc(self.ln(b))
        b = b + self.fc2(self.ln2(a))
        return torch.cat([a, b], dim=-1) if self.joined else torch.cat([a, b], dim=1)


def test_cat_and_chunk_along_tokens_keep_the_stream(feed):
    report = _exact(Halves(False), feed, [ids()], [ids(3, 5)])
    assert report.num_converted == 3


def test_a_norm_over_a_cat_along_the_hidden_dim_is_refused(feed):
    _refused(Halves(True), feed, [ids()], "ln_f", "concatenation along the hidden dim")


# 4. means and pools over tokens
class Pool(Toy):
    def __init__(self, pool):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.pool = pool

    def block(self, x):
        x = x + self.fc(self.ln(x))
        return self.pool(x.permute(0, 2, 1)).permute(0, 2, 1)   # (b, d, n): pool over time


def test_average_pool_over_time_keeps_the_stream(feed):
    _exact(Pool(nn.AvgPool1d(2, stride=2)), feed, [ids()], [ids(3, 10)])


def test_max_pool_over_time_is_refused(feed):
    _refused(Pool(nn.MaxPool1d(2, stride=2)), feed, [ids()], "ln_f", "max_pool1d")


# 5. mixtures of experts: per-token weighted sums of expert outputs
class Experts(Toy):
    def __init__(self, per_channel: bool):
        super().__init__()
        self.router = nn.Linear(D, 3)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.gate = nn.Linear(D, D) if per_channel else None
        self.per_channel = per_channel

    def block(self, x):
        h = self.ln(x).view(-1, D)
        weights, chosen = self.router(h).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            y = expert(h[token]) * weights[token, slot, None]
            if self.per_channel:   # a gated channel mix: the weight depends on the channel
                y = y * torch.sigmoid(self.gate(h[token]))
            out.index_add_(0, token, y)
        return x + out.view(x.shape)


def test_expert_weighted_sum_keeps_the_stream(feed):
    _exact(Experts(False), feed, [ids(4, 16)], [ids(3, 9)])


def test_per_channel_gate_is_refused(feed):
    _refused(Experts(True), feed, [ids(4, 16)], "ln_f", "mul by a per-channel tensor")


# 6. nn.MultiheadAttention: its out_proj writes the input of the pooling head's norm
class Pooling(Toy):
    """SigLIP's head: attention from a probe over the normalised stream; its output starts a new stream."""

    def __init__(self, read_raw: bool):
        super().__init__()
        self.fc, self.ln_kv = nn.Linear(D, D), nn.LayerNorm(D)
        self.probe = nn.Parameter(torch.randn(1, 1, D, generator=G))
        self.attention = nn.MultiheadAttention(D, H, batch_first=True)
        self.read_raw = read_raw

    def block(self, x):
        x = x + self.fc(self.ln(x))
        z = self.ln_kv(x)
        y = self.attention(self.probe.expand(x.shape[0], -1, -1), z, z)[0]
        return y * y.sum(-1, keepdim=True) if self.read_raw else y   # the raw sum: a use of out_proj's output


def test_multihead_attention_out_proj_is_centred(feed):
    _exact(Pooling(False), feed, [ids()], [ids(3, 5)])


def test_multihead_attention_output_read_raw_is_refused(feed):
    _refused(Pooling(True), feed, [ids()], "attention.out_proj", "ln_f", "sum")


# 7. a fused q/k/v projection read by per-head q and k norms: q and k centred per head, v untouched
class FusedQKV(Toy):
    def __init__(self, read_q: bool):
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.q_norm, self.k_norm = nn.LayerNorm(D // H), nn.LayerNorm(D // H)
        self.read_q = read_q

    def block(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, n, H, 3, D // H).unbind(3)
        q0 = q
        q, k = self.q_norm(q), self.k_norm(k)
        if self.read_q:   # the projection's q read unnormalised too
            q = q + q0
        att = (q.transpose(1, 2) @ k.permute(0, 2, 3, 1)).softmax(-1) @ v.transpose(1, 2)
        return x + self.out(att.transpose(1, 2).reshape(b, n, D))


def test_fused_qkv_centred_per_head(feed):
    report = _exact(FusedQKV(False), feed, [ids()], [ids(3, 5)])
    assert report.num_converted == 4


def test_fused_qkv_read_unnormalised_is_refused(feed):
    _refused(FusedQKV(True), feed, [ids()], "qkv", "q_norm", "add")


# 8. masked_scatter: features written into whole rows of the text embeddings (Fuyu's, LLaVA's image tokens)
class Scatter(Toy):
    def __init__(self, whole_rows: bool):
        super().__init__()
        self.fc, self.vision = nn.Linear(D, D), nn.Linear(D, D)
        self.whole_rows = whole_rows

    def block(self, x):
        features = self.vision(torch.ones(x.shape[0], 2, D))
        rows = (torch.arange(x.shape[1]) % 3 == 1).view(1, -1, 1)
        mask = rows.expand_as(x) if self.whole_rows else rows & (torch.arange(D) < D // 2)   # half a row
        mask = mask.expand_as(x).contiguous()
        features = features.repeat(1, x.shape[1], 1).flatten()[:int(mask.sum())]
        x = x.masked_scatter(mask, features)
        return x + self.fc(self.ln(x))


def test_masked_scatter_of_whole_rows_keeps_the_stream(feed):
    report = _exact(Scatter(True), feed, [ids()], [ids(3, 7)])
    assert report.num_converted == 2


def test_masked_scatter_into_part_of_a_row_is_refused(feed):
    _refused(Scatter(False), feed, [ids()], "ln_f", "differently laid out")
