"""ExportReport: what `export_onnx` wrote and what its validation measured."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class ExportReport:
    path: str
    target: str
    opset: int
    fp16: bool
    with_past: bool
    output: str                                              # "logits" | "last_hidden_state" | module: names
    norms: dict[str, int] = field(default_factory=dict)      # in the model: rmsnorm, prmsnorm, layernorm
    fused: dict[str, int] = field(default_factory=dict)      # norm nodes in the ORT-optimised graph
    rewrites: dict[str, int] = field(default_factory=dict)   # onnxscript fusion rules applied
    parity: list[dict] = field(default_factory=list)         # per (batch, seq): max_abs, ref_max, finite
    tolerance: float | None = None                           # on max_abs
    generation: dict | None = None                           # with_past: greedy tokens ORT vs PyTorch
    external_data: bool = False                              # weights in <file>.data beside the graph
    files: list[str] = field(default_factory=list)           # export_folder: what the folder holds
    latency_ms: float | None = None                          # ORT CPU, batch 1, 32 tokens, median
    quantized: dict | None = None                            # int8: what `quantize.quantize` measured
    fingerprint: dict = field(default_factory=dict)          # in the file's metadata: `onnx_fingerprint.summary`
    fixed_shapes: str | None = None                          # why the graph keeps the example's input shapes
    validated: bool = False

    @property
    def max_abs(self) -> float | None:
        return max((r["max_abs"] for r in self.parity), default=None)

    def to_dict(self) -> dict:
        return {**asdict(self), "max_abs": self.max_abs}

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def to_table(self) -> str:
        kind = "fp16" if self.fp16 else "fp32"
        past = ", with past" if self.with_past else ""
        lines = [f"exported {self.path} (target {self.target}, opset {self.opset}, {kind}{past}; "
                 f"output {self.output})"]
        norms = ", ".join(f"{v} {k}" for k, v in self.norms.items() if v and k != "lowered") or "none"
        fused = ", ".join(f"{v} {k}" for k, v in sorted(self.fused.items())) or "none"
        lines.append(f"norms in model: {norms}; norm nodes in ORT-optimised graph: {fused}")
        if self.fixed_shapes:
            lines.append(f"inputs of the example's fixed shapes only: {self.fixed_shapes}")
        if self.norms.get("prmsnorm"):
            lines.append("pRMSNorm has no fused ONNX op: exported op by op (Slice, Pow, ReduceMean, Sqrt, Div)")
        for r in self.parity:   # a module exported on example inputs: per output and batch (`validate_module`)
            lines.append(f"max |Δ{r['output']}| ORT vs PyTorch on {r['inputs']}: {r['max_abs']:.3e} (tolerance "
                         f"{r['tolerance']:.1e})" if "inputs" in r else
                         f"max |Δ{self.output}| ORT vs PyTorch at batch {r['batch']}, seq {r['seq']}: "
                         f"{r['max_abs']:.3e} (tolerance {self.tolerance:.1e})")
        if self.generation:
            g = self.generation
            lines.append(f"greedy generation, {g['new_tokens']} tokens: "
                         f"{'same tokens in ORT and PyTorch' if g['match'] else 'MISMATCH'}")
            if "padded_rows_match" in g:
                ok, n = sum(g["padded_rows_match"]), len(g["prompt_lengths"])
                lines.append(f"left-padded batch (prompt lengths {g['prompt_lengths']}): {ok}/{n} rows equal "
                             "PyTorch and the prompt alone")
        if self.fingerprint:
            lines.append(_fingerprint_line(self.fingerprint))
        if self.external_data:
            lines.append(f"weights stored as external data: {self.path}.data")
        if self.files:
            lines.append(f"folder: {', '.join(self.files)}")
        if self.latency_ms is not None:
            lines.append(f"ORT CPU latency (batch 1, 32 tokens): {self.latency_ms:.2f} ms")
        if self.quantized:
            lines += _quantized_lines(self.quantized)
        return "\n".join(lines)

    __str__ = to_table


def _quantized_lines(q: dict) -> list[str]:
    """The int8 model written instead of the fp32 one validated above: how, and its (inexact) error."""
    ops = ", ".join(f"{v} {k}" for k, v in q["ops"].items())
    error = f"max relative error {q['max_rel']:.2e}"
    if "top1" in q:
        error += f", KL {q['kl']:.2e}, top-1 agreement {q['top1']:.1%} over {q['positions']} positions"
    mib = {k: v / 2**20 for k, v in q["bytes"].items()}
    lines = [f"quantized {q['scheme']} (weights {q['weights']}; activations {q['activations']}): {ops}; "
             f"{mib['fp32']:.1f} MiB -> {mib['int8']:.1f} MiB",
             f"int8 vs PyTorch fp32 on the validation inputs: {error}"]
    if q.get("latency_ms") is not None:
        lines.append(f"int8 ORT CPU latency (batch 1, 32 tokens): {q['latency_ms']:.2f} ms")
    return lines


def _fingerprint_line(f: dict) -> str:
    """The fingerprint in the file's metadata: what it holds and whether onnxruntime reproduced it here."""
    if "none" in f:
        return f"no fingerprint in the file's metadata: {f['none']}"
    origin = "its conversion's probe" if f["probe_from"] == "model" else "the export's own probe"
    line = (f"fingerprint in the file's metadata: {', '.join(f['outputs'])} on {origin} ({f['dtype']}, tolerance "
            f"{f['tolerance']:g}){': reproduced in ORT' if f.get('checked') else ', not checked'}")
    saved = f.get("saved")
    if isinstance(saved, list):
        line += f"; with the digest its folder recorded ({', '.join(saved)})"
    elif saved is not None:
        line += f"; not the folder's recorded digest: {saved['none']}"
    return line
