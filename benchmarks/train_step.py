"""GPT-2-small training step: the LayerNorm original against the converted model on normswap's kernels.

    python benchmarks/train_step.py                 # batch 8 x 1024 tokens, bf16 weights
    python benchmarks/train_step.py --quick         # 2 x 256 tokens, few steps
    python benchmarks/train_step.py --compile       # torch.compile every variant

A 124M GPT-2 (random weights, from config) runs forward + backward on the same token batch in each
variant: original (nn.LayerNorm), converted (`normswap.convert(model, to="rmsnorm", method="naive")`,
Triton kernels through the CUDA auto-dispatch), converted + fused residual (`fuse_residual_norms`), and
converted on the PyTorch path (NORMSWAP_BACKEND=torch) to separate the kernel from the conversion.
No optimizer step: it is identical across variants and would only dilute the difference.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys

DEVICE = "cuda"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help="batch 2 x 256 tokens, 3 timed steps")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                    help="parameter dtype (pure, no autocast); default bf16")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="torch.compile each model")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("no CUDA device: benchmarks/train_step.py needs a GPU", file=sys.stderr)
        return 0
    import transformers

    import normswap
    from normswap.surgery.add_norm import fuse_residual_norms

    if args.quick:
        args.batch, args.seq, args.steps, args.warmup = 2, 256, 3, 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    base = transformers.GPT2LMHeadModel(config).to(DEVICE, dtype).train()
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=DEVICE)

    def converted(fused: bool):
        model = copy.deepcopy(base)
        normswap.convert(model, to="rmsnorm", method="naive")
        if fused:
            fuse_residual_norms(model)
        return model

    variants = [("LayerNorm (original)", lambda: copy.deepcopy(base), "auto"),
                ("RMSNorm, normswap Triton", lambda: converted(False), "auto"),
                ("RMSNorm, Triton + fused residual", lambda: converted(True), "auto"),
                ("RMSNorm, PyTorch path", lambda: converted(False), "torch")]

    def step(model):
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    results = []
    for name, build, backend in variants:
        os.environ["NORMSWAP_BACKEND"] = backend
        model = build()
        run = torch.compile(model) if args.compile else model
        for _ in range(args.warmup):
            step(run)
        torch.cuda.synchronize()
        times = []
        for _ in range(args.steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(run)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        results.append((name, statistics.median(times)))
        del model, run
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    os.environ.pop("NORMSWAP_BACKEND", None)

    import triton
    tokens = args.batch * args.seq
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}, "
          f"transformers {transformers.__version__}; {datetime.date.today()}")
    print(f"GPT-2 small (124M), {args.dtype} weights, batch {args.batch} x {args.seq} tokens, forward+backward, "
          f"{'torch.compile, ' if args.compile else ''}median of {args.steps} steps\n")
    print("| model | ms/step | tokens/s | vs original |")
    print("|---|---|---|---|")
    base_ms = results[0][1]
    for name, ms in results:
        print(f"| {name} | {ms:.1f} | {tokens / ms * 1e3:,.0f} | {base_ms / ms:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
