"""`rotate_checkpoint`: what `normswap rotate` runs, for Python callers too: load SRC (converted exactly, or
RMSNorm already: a Llama, Qwen, Mistral, Gemma... folder, saved again as its own architecture),
rotate its residual streams (`surgery.rotate`), verified against its own outputs, and save it to OUT (written
in a temporary folder and renamed: nothing appears, nothing is lost, if any step fails)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from normswap.errors import NormswapError
from normswap.io import safetensors
from normswap.io.atomic import check_output, check_replaceable
from normswap.models.inputs.examples import batches_of, check_examples
from normswap.models.load import load_model
from normswap.models.save import save_pretrained
from normswap.models.source import check_code, read_source, source_folder
from normswap.pipeline.device import resolve_device
from normswap.pipeline.options import RotateOptions
from normswap.surgery.orthogonal import METHODS
from normswap.surgery.rotate import RotationReport, rotate

DEFAULTS = RotateOptions()   # frozen


@dataclass
class RotateResult:
    report: RotationReport
    output: str

    def to_dict(self) -> dict:
        return {"report": self.report.to_dict(), "output": self.output}


def rotate_checkpoint(src: str, out: str | Path, options: RotateOptions = DEFAULTS) -> RotateResult:
    """Rotate the model at `src` (a folder `normswap convert --method exact` wrote, a model that is RMSNorm
    already, or a Hub id of one) and save it to `out`; refused, naming the part, where it cannot be rotated
    exactly."""
    o, out = options, str(out)
    if o.method not in METHODS:
        raise NormswapError(f"unknown rotation method '{o.method}': choose hadamard or random")
    inputs = [("`src`", src)] + ([("`example_inputs`", o.example_inputs)]
                                 if isinstance(o.example_inputs, (str, Path)) else [])
    check_output(out, inputs)
    check_replaceable(out, o.overwrite)
    safetensors.parse_size(o.max_shard_size)   # a bad size fails before any work
    source = read_source(src)
    if source.local:
        check_code(src, source.config, o.load.trust_remote_code, converting=True)
    device = resolve_device(o.device)
    examples = batches_of(o.example_inputs) or None
    check_examples(examples)
    model, tokenizer = load_model(src, options=o.load)
    model.to(device)
    report = rotate(model, o.method, o.seed, examples, o.heads, o.online)
    save_pretrained(model, out, tokenizer=tokenizer, overwrite=o.overwrite, max_shard_size=o.max_shard_size,
                    source=source_folder(src))
    return RotateResult(report, out)
