"""Rotation for quantization (issue 34): what `normswap.rotate` buys under torchao's W8A8 and int4 weight-only
quantization (and onnxruntime's dynamic int8 with --ort), on the bundled demo model (real trained weights) and
a GPT-2-small-sized random-init model.

For each model: the original (LayerNorm), the exact RMSNorm conversion, and that conversion rotated by a
randomised Hadamard matrix and by a random orthogonal one. Each is quantized and scored on held-out text
(normswap/demo/heldout.txt, windows of `--seq` tokens): KL(original || quantized) per token, averaged, and
perplexity. Every linear layer is quantized but the LM head (as QuaRot keeps it); GPT-2's Conv1D layers are
turned into nn.Linear first (torchao quantizes nn.Linear). Also, per layer, the residual stream's max|x|/RMS
and kurtosis over channels (averaged over tokens), and the same for the input of each block's first linear
layer (what W8A8 quantizes per token), before and after rotation.

    python benchmarks/rotation.py [--parts demo,small,outlier] [--windows 64] [--small-windows 12] [--ort]
                                  [--schemes fp32,w8a8,int4wo] [--markdown FILE]

--ort adds "ort-int8": the model exported by `normswap.export_onnx(..., quantize="int8")` (what `normswap export
--quantize int8` writes: onnxruntime's dynamic int8, weights per channel) and run in onnxruntime.
"""
from __future__ import annotations

import argparse
import copy
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers as tf
from torch import nn

import normswap

HELDOUT = Path(normswap.__file__).parent / "demo" / "heldout.txt"


def windows(tokenizer, n: int, seq: int) -> torch.Tensor:
    ids = tokenizer(HELDOUT.read_text())["input_ids"]
    n = min(n, len(ids) // seq)
    return torch.tensor(ids[: n * seq]).view(n, seq)


def linearised(model: nn.Module) -> nn.Module:
    """A copy with every GPT-2 Conv1D replaced by the nn.Linear computing the same."""
    model = copy.deepcopy(model)
    for name, m in list(model.named_modules()):
        if type(m).__name__ == "Conv1D":
            lin = nn.Linear(m.weight.shape[0], m.weight.shape[1])
            with torch.no_grad():
                lin.weight.copy_(m.weight.T)
                lin.bias.copy_(m.bias)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, lin)
    return model


def quantized(model: nn.Module, scheme: str) -> nn.Module:
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup
    m = linearised(model)
    if scheme == "fp32":
        return m
    config = Int8DynamicActivationInt8WeightConfig() if scheme == "w8a8" else \
        IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))
    quantize_(m, config, filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear) and not fqn.endswith("lm_head"))
    return m


@torch.no_grad()
def log_probs(model: nn.Module, ids: torch.Tensor, batch: int = 4) -> torch.Tensor:
    out = [torch.log_softmax(model(input_ids=ids[i:i + batch]).logits.float(), -1) for i in range(0, len(ids), batch)]
    return torch.cat(out)


def kl_ppl(ref: torch.Tensor, logp: torch.Tensor, ids: torch.Tensor) -> tuple[float, float]:
    kl = (ref.exp() * (ref - logp)).sum(-1).mean().item()
    nll = -logp[:, :-1].gather(-1, ids[:, 1:, None]).mean().item()
    return kl, float(torch.exp(torch.tensor(nll)))


def _ratios(x: torch.Tensor) -> tuple[float, float]:
    """(mean over tokens of max|x|/RMS, mean over tokens of the kurtosis over channels) of x (..., d)."""
    x = x.double().flatten(0, -2)
    rms = x.pow(2).mean(-1).sqrt()
    c = x - x.mean(-1, keepdim=True)
    kurt = c.pow(4).mean(-1) / c.pow(2).mean(-1).pow(2)
    return (x.abs().amax(-1) / rms).mean().item(), kurt.mean().item()


@torch.no_grad()
def activation_stats(model: nn.Module, ids: torch.Tensor, first_linear: str) -> list[tuple]:
    """Per layer: (stream max/RMS, stream kurtosis, first linear's input max/RMS, its kurtosis)."""
    seen: dict[str, torch.Tensor] = {}
    names = [n for n, _ in model.named_modules() if n.endswith(first_linear)]
    hooks = [model.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: seen.__setitem__(n, a[0]))
             for n in names]
    try:
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    finally:
        for h in hooks:
            h.remove()
    return [(*_ratios(hidden[i]), *_ratios(seen[n])) for i, n in enumerate(names)]


def ort_logprobs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model exported as `normswap export --quantize int8` writes it, run in onnxruntime."""
    import onnxruntime as ort
    with tempfile.TemporaryDirectory() as d:
        dst = Path(d) / "q.onnx"
        report = normswap.export_onnx(model, dst, quantize="int8")
        q = report.quantized
        print(f"    export's own check: KL {q['kl']:.3e}, top-1 {q['top1']:.1%}", file=sys.stderr, flush=True)
        sess = ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"])
        names = {i.name for i in sess.get_inputs()}
        outs = []
        for row in ids:
            feed = {"input_ids": row[None].numpy()}
            if "attention_mask" in names:
                feed["attention_mask"] = torch.ones_like(row[None]).numpy()
            if "position_ids" in names:
                feed["position_ids"] = torch.arange(len(row))[None].numpy()
            outs.append(torch.log_softmax(torch.from_numpy(sess.run(None, feed)[0]).float(), -1))
        return torch.cat(outs)


def variants(model: nn.Module) -> dict[str, nn.Module]:
    conv = copy.deepcopy(model)
    normswap.convert(conv, method="exact")
    return {"original (LayerNorm)": model, "exact RMSNorm": conv, **rotated_copies(conv, "rotated")}


def rotated_copies(model: nn.Module, label: str) -> dict[str, nn.Module]:
    """`model` rotated by each method (seed 0), labelled with the Q used."""
    out = {}
    for method in ("hadamard", "random"):
        rotated = copy.deepcopy(model)
        report = normswap.rotate(rotated, method=method, seed=0)
        out[f"{label}, {report.streams[0]['q']}"] = rotated
    return out


@torch.no_grad()
def householder_outlier(conv: nn.Module, ids: torch.Tensor) -> nn.Module:
    """A copy of the converted `conv` rotated (exactly, through `normswap.rotate`) by the Householder reflection
    that maps the stream's top principal direction onto channel 0: the same function, with one outlier
    channel carrying the stream's largest shared component, as trained LLMs' massive activations do."""
    from normswap.surgery import rotate as rotate_module
    hs = conv(input_ids=ids, output_hidden_states=True).hidden_states[:-1]
    x = torch.cat([h.flatten(0, 1) for h in hs]).double()
    v = torch.linalg.svd(x, full_matrices=False).Vh[0]
    e = torch.zeros_like(v)
    e[0] = 1.0
    u = v - e if v[0] < 0.99 else v + e
    h = torch.eye(len(v), dtype=torch.float64) - 2 * torch.outer(u, u) / u.dot(u)   # H e0 = ±v
    out, real = copy.deepcopy(conv), rotate_module.rotation
    rotate_module.rotation = lambda n, method, seed: (h, "Householder onto channel 0")
    try:
        normswap.rotate(out)
    finally:
        rotate_module.rotation = real
    return out


def outlier_variants(model: nn.Module, ids: torch.Tensor) -> dict[str, nn.Module]:
    conv = copy.deepcopy(model)
    normswap.convert(conv, method="exact")
    spiked = householder_outlier(conv, ids[:8])
    return {"original (LayerNorm)": model, "exact RMSNorm, outlier channel made": spiked,
            **rotated_copies(spiked, "outlier model rotated")}


def measure(title: str, model: nn.Module, ids: torch.Tensor, schemes: list[str], outlier: bool = False) -> list[str]:
    t0 = time.time()
    models = outlier_variants(model.eval(), ids) if outlier else variants(model.eval())
    ref = log_probs(model, ids)
    lines = [f"### {title}: {ids.numel()} held-out tokens ({ids.shape[0]} windows of {ids.shape[1]})", "",
             "| model | " + " | ".join(f"{s} KL | {s} ppl" for s in schemes) + " |",
             "|---|" + "---|---|" * len(schemes)]
    for name, m in models.items():
        cells = []
        for s in schemes:
            logp = ort_logprobs(m, ids) if s == "ort-int8" else log_probs(quantized(m, s), ids)
            kl, ppl = kl_ppl(ref, logp, ids)
            cells += [f"{kl:.3e}", f"{ppl:.2f}"]
            print(f"  {name} {s}: KL {kl:.3e} ppl {ppl:.2f}", file=sys.stderr, flush=True)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Per layer, mean over tokens: residual stream max|x|/RMS and kurtosis; the input of each "
              "block's first linear layer (W8A8 quantizes it per token), the same:", "",
              "| model | layer | stream max/RMS | stream kurtosis | qkv input max/RMS | qkv input kurtosis |",
              "|---|---|---|---|---|---|"]
    first = "attn.c_attn" if hasattr(model, "transformer") else "q_proj"
    for name in list(models)[1:]:
        for i, row in enumerate(activation_stats(models[name], ids[:8], first)):
            lines.append(f"| {name} | {i} | " + " | ".join(f"{v:.2f}" for v in row) + " |")
    lines += ["", f"({time.time() - t0:.0f} s)", ""]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--small-windows", type=int, default=12)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--parts", default="demo,small", help="Comma-separated: demo, small, outlier (the demo with "
                    "one outlier channel made first, the same function).")
    ap.add_argument("--ort", action="store_true")
    ap.add_argument("--schemes", default="fp32,w8a8,int4wo", help="Comma-separated: fp32, w8a8, int4wo "
                    "(--ort adds ort-int8).")
    ap.add_argument("--markdown", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    model, tok = normswap.load_model("normswap-demo", dtype="float32")
    ids = windows(tok, a.windows, a.seq)
    lines = [f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.processor() or platform.machine()}, "
             f"{torch.get_num_threads()} threads, torch {torch.__version__}", ""]
    parts = a.parts.split(",")
    schemes = a.schemes.split(",") + (["ort-int8"] if a.ort else [])
    if "demo" in parts:
        lines += measure("normswap-demo (GPT-2 shape, 4 layers, width 256, trained)", model, ids, schemes)
    if "outlier" in parts:
        lines += measure("normswap-demo with one outlier channel made by an exact Householder rotation", model, ids,
                         schemes, outlier=True)
    if "small" in parts:
        small = tf.GPT2LMHeadModel(tf.GPT2Config(n_positions=a.seq)).eval()   # 124M, random init
        lines += measure("GPT-2-small-sized, random init (width 768: 64 x Paley 12)", small,
                         windows(tok, a.small_windows, a.seq), schemes)
    text = "\n".join(lines)
    print(text)
    if a.markdown:
        Path(a.markdown).write_text(text)


if __name__ == "__main__":
    main()
