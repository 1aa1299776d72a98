"""The workflows' typed, frozen options: one dataclass per verb, taken by its workflow function.

Each field's metadata says how the command line sets it (flag, help, choices, bounds...): the CLI generates its
click options, and the flag names its errors show, from these fields (`normswap.cli.flags` lists the keys).
A nested options object (`load`, `heal`) brings its own fields' flags.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import get_args

from normswap.choices import ExportTarget, GraphDtype, Quantize, Rotation, choice
from normswap.healing.options import HealOptions
from normswap.io import safetensors
from normswap.models.load import LoadOptions
from normswap.export.onnx import graph_dtype
from normswap.norms import NormType
from normswap.surgery.methods import Method

DEVICE = dict(flag="--device", show_default=True, help="auto (CUDA when available), cpu, cuda, cuda:N.")
OVERWRITE = dict(flag="--overwrite", help="Replace the output if normswap wrote it (or it is empty).",
                 also={"any": ("--overwrite-any",
                               "Replace the output even if normswap did not write it (its files are deleted).")})


@dataclass(frozen=True)
class ConvertOptions:
    """Everything `convert_checkpoint` does besides naming SRC and OUT (`normswap convert`'s options)."""
    to: str = field(default="rmsnorm", metadata=dict(   # a NormType
        flag="--to", choices=NormType.values(), required=True))
    method: str = field(default="auto", metadata=dict(   # a Method
        flag="--method", choices=Method.values(), show_default=True))
    p: float | None = field(default=None, metadata=dict(   # pRMSNorm fraction (default 0.0625)
        flag="--p", type=float, help="pRMSNorm fraction of features (default 0.0625)."))
    load: LoadOptions = LoadOptions()     # dtype, trust_remote_code, allow_missing_weights
    device: str = field(default="auto", metadata=DEVICE)   # where the model is converted and compared
    # batches (or a file of them) traced and verified on besides normswap's samples (`convert`'s example_inputs)
    example_inputs: object = field(default=None, metadata=dict(
        flag="--inputs", type="path", metavar="FILE",
        help="Example inputs to trace and verify on, besides normswap's own (safetensors or torch.save file)."))
    finetune_steps: int = field(default=0, metadata=dict(   # then heal this many distillation steps on `data`
        flag="--finetune-steps", type=int, min=0,
        help="Then heal: N distillation steps from the original on --data."))
    data: tuple[str, ...] = field(default=(), metadata=dict(   # text files (or folders of .txt) to heal on
        flag="--data", multiple=True, type="path",
        help="Text file(s) for --finetune-steps (normswap-demo: the demo's heal text, no held-out chapter)."))
    # then rotate the residual streams (`surgery.rotate`, QuaRot style); needs method "exact"
    rotate: bool = field(default=False, metadata=dict(
        flag="--rotate", is_flag=True,
        help="Then rotate the residual streams for quantization (needs --method exact; converts in memory)."))
    rotate_method: Rotation = field(default="hadamard", metadata=dict(
        flag="--rotate-method", choices=get_args(Rotation), show_default=True,
        help="With --rotate: hadamard (randomised Hadamard) or random (random orthogonal)."))
    seed: int | None = field(default=None, metadata=dict(   # None: 0
        flag="--seed", type=int, help="With --rotate: draws the Hadamard signs or the random matrix (default 0)."))
    rotate_heads: bool = field(default=False, metadata=dict(   # `normswap rotate --heads`
        flag="--rotate-heads", is_flag=True,
        help="With --rotate: also each attention head's values and output projection (QuaRot's R2, folded)."))
    rotate_online: bool = field(default=False, metadata=dict(   # `normswap rotate --online`
        flag="--rotate-online", is_flag=True,
        help="With --rotate: also each MLP down projection's input, at run time by a fast Hadamard transform "
             "(QuaRot's R4)."))
    onnx: str | None = field(default=None, metadata=dict(   # then export to this ONNX file (target ort)
        flag="--onnx", type="path", help="Then export to this ONNX file (target ort)."))
    max_shard_size: int | str = field(default=safetensors.DEFAULT_MAX_SHARD_SIZE, metadata=dict(
        flag="--max-shard-size", default="50GB", show_default=True,
        help="Split the weights into shards of at most this size (e.g. 5GB) with an index."))
    # True: replace OUT if normswap wrote it; "any": whatever it is
    overwrite: bool | str = field(default=False, metadata=OVERWRITE)
    show_progress: bool = False           # progress bars on stderr

    def __post_init__(self):
        choice(self.rotate_method, Rotation, "rotation method")


@dataclass(frozen=True)
class RotateOptions:
    """Everything `rotate_checkpoint` does besides naming SRC and OUT (`normswap rotate`'s options)."""
    method: Rotation = field(default="hadamard", metadata=dict(
        flag="--method", choices=get_args(Rotation), show_default=True,
        help="hadamard: a randomised Hadamard matrix (random orthogonal where the width has none); random: a "
             "random orthogonal matrix."))
    seed: int = field(default=0, metadata=dict(flag="--seed", type=int, show_default=True,
                                               help="Draws the Hadamard signs or the random matrix."))
    heads: bool = field(default=False, metadata=dict(   # QuaRot's R2 (`surgery.heads`)
        flag="--heads", is_flag=True,
        help="Also rotate each attention head's values and the output projection reading them (QuaRot's R2, "
             "folded into their weights)."))
    online: bool = field(default=False, metadata=dict(   # QuaRot's R4 (`surgery.online`)
        flag="--online", is_flag=True,
        help="Also rotate the input of each layer writing the stream from an activation (an MLP's down projection) "
             "at run time by a fast Hadamard transform (QuaRot's R4; saved with the shipped modeling file)."))
    load: LoadOptions = LoadOptions()
    device: str = field(default="auto", metadata=DEVICE)   # where the model is rotated and verified
    example_inputs: object = field(default=None, metadata=dict(
        flag="--inputs", type="path", metavar="FILE",
        help="Example inputs to trace and verify on, besides normswap's own (safetensors or torch.save file)."))
    max_shard_size: int | str = field(default=safetensors.DEFAULT_MAX_SHARD_SIZE, metadata=dict(
        flag="--max-shard-size", default="50GB", show_default=True,
        help="Split the weights into shards of at most this size (e.g. 5GB) with an index."))
    overwrite: bool | str = field(default=False, metadata=OVERWRITE)

    def __post_init__(self):
        choice(self.method, Rotation, "rotation method")


@dataclass(frozen=True)
class HealCheckpointOptions:
    """Everything `heal_checkpoint` does besides naming SRC and OUT (`normswap heal`'s options)."""
    teacher: str | None = field(default=None, metadata=dict(   # the original model (needed by objective kd)
        flag="--teacher", help="The original model (folder, Hub id, normswap-demo)."))
    data: tuple[str, ...] = field(default=(), metadata=dict(   # text files (or folders of .txt) to heal on
        flag="--data", multiple=True, type="path",
        help="Text file or folder of .txt (repeatable); normswap-demo: the demo's heal text (Persuasion ch. 1-20, "
             "never the held-out chapters eval scores).",
        aliases={"texts": "--data FILE"}))
    heal: HealOptions = HealOptions()     # steps, lr, train, objective, LoRA, held-out evaluation, trackers
    fsdp: bool | None = field(default=None, metadata=dict(   # shard the student (None: as the launch asks)
        flag="--fsdp", is_flag=True,
        help="Shard the model over the processes (FSDP2); implied by an FSDP accelerate config."))
    plot: str | None = field(default=None, metadata=dict(   # then draw the curves into this PNG
        flag="--plot", type="path", metavar="PNG",
        help="Draw the training and held-out curves into this PNG (needs matplotlib)."))
    load: LoadOptions = LoadOptions()
    device: str = field(default="auto", metadata=DEVICE)
    overwrite: bool | str = field(default=False, metadata=OVERWRITE)
    show_progress: bool = False


@dataclass(frozen=True)
class EvaluateOptions:
    """Everything `evaluate_checkpoint` does besides naming SRC (`normswap eval`'s options)."""
    data: tuple[str, ...] = field(default=(), metadata=dict(   # text files to score; () the bundled held-out text
        flag="--data", multiple=True, type="path", aliases={"texts": "--data FILE"},
        help="Text file(s) to score (default: the held-out Austen chapters shipped with normswap)."))
    reference: str | None = field(default=None, metadata=dict(   # the original model, compared with
        flag="--reference", error="--reference ORIG",
        help="Original model: adds KL and top-1 agreement (encoders: embedding cosine)."))
    seq_len: int | None = field(default=None, metadata=dict(
        flag="--seq-len", type=int, min=2, help="Window (default: model context)."))
    stride: int | None = field(default=None, metadata=dict(
        flag="--stride", type=int, min=1, help="Default: seq-len // 2."))
    batch_size: int = field(default=8, metadata=dict(flag="--batch-size", type=int, min=1, show_default=True))
    load: LoadOptions = LoadOptions()
    device: str = field(default="auto", metadata=DEVICE)
    show_progress: bool = False


@dataclass(frozen=True)
class ExportOptions:
    """Everything `export_checkpoint` does besides naming SRC and OUT (`normswap export`'s options)."""
    onnx: str | None = field(default=None, metadata=dict(   # a single ONNX file instead of the folder OUT
        flag="--onnx", type="path", help="A single ONNX file instead."))
    # checked with the opset when exporting (`export.onnx.check_args`), after the output's own checks
    target: ExportTarget = field(default="ort", metadata=dict(
        flag="--target", show_default=True,
        help="ort: SimplifiedLayerNormalization (+Skip) for onnxruntime; onnx23: standard RMSNormalization."))
    # the graph's (the model loads as stored; float16 and torch.float16 are fp16); "bf16" is refused when
    # exporting: onnxruntime's CPU provider, which validates every export, has no bf16 kernels
    dtype: GraphDtype = field(default="fp32", metadata=dict(
        flag="--dtype", choices=get_args(GraphDtype), show_default=True,
        help="Weights and activations of the graph (fp16: norm statistics stay fp32; bf16: refused, "
             "onnxruntime's CPU cannot run it to validate it).",
        also={"fp16": ("--fp16", "Same as --dtype fp16.")}))
    with_past: bool | None = field(default=None, metadata=dict(   # None: on for decoders into OUT, off with onnx
        flag="--with-past", secondary="--no-past",
        help="Decoder with past key/values in and out (default: on for decoders with -o, off with --onnx)."))
    opset: int | None = field(default=None, metadata=dict(
        flag="--opset", type=int, help="ONNX opset (ort: 18-23, default 18; onnx23: 23)."))
    # then write the validated fp32 graph's int8 quantization instead, its error measured (`export.quantize`)
    quantize: Quantize | None = field(default=None, metadata=dict(
        flag="--quantize", choices=get_args(Quantize),
        help="Write the graph quantized: int8 weights of MatMul/Gemm, dynamic uint8 activations (after "
             "validating the fp32 graph; its error vs PyTorch is reported, refused only if broken)."))
    load: LoadOptions = LoadOptions()
    device: str = field(default="auto", metadata=DEVICE)
    overwrite: bool | str = field(default=False, metadata=OVERWRITE)

    def __post_init__(self):
        object.__setattr__(self, "dtype", graph_dtype(self.dtype))
        if self.quantize is not None:
            choice(self.quantize, Quantize, "quantization")


@dataclass(frozen=True)
class InspectOptions:
    """How `inspect_checkpoint` loads SRC and where it traces it (`normswap inspect`'s options)."""
    load: LoadOptions = LoadOptions()
    device: str = field(default="auto", metadata=DEVICE)   # where the traced forward runs


@dataclass(frozen=True)
class PlotOptions:
    """`normswap plot`'s options."""
    overwrite: bool | str = field(default=False, metadata=OVERWRITE)


@dataclass(frozen=True)
class GenerateOptions:
    """Everything `generate_checkpoint` does besides naming SRC and the prompt (`normswap generate`'s options)."""
    max_new_tokens: int = field(default=40, metadata=dict(
        flag="--max-new-tokens", type=int, min=1, show_default=True, help="Tokens to generate after the prompt."))
    sample: bool = field(default=False, metadata=dict(   # False: greedy, whatever generation_config.json says
        flag="--sample", secondary="--greedy", show_default=True,
        help="Sample (with --temperature and --seed) instead of greedy decoding."))
    temperature: float = field(default=1.0, metadata=dict(
        flag="--temperature", type=float, min=0, min_open=True, show_default=True, help="With --sample."))
    seed: int = field(default=0, metadata=dict(flag="--seed", type=int, show_default=True, help="With --sample."))
    load: LoadOptions = LoadOptions()
    device: str = field(default="auto", metadata=DEVICE)
