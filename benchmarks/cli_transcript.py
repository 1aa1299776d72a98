"""Every command's stdout, stderr and exit code on fixed inputs: what a behaviour-neutral change must leave as it
was (a restructuring step). Run it before and after, and diff the two transcripts.

    python benchmarks/cli_transcript.py before.txt          # ~6 min on 2 cores
    python benchmarks/cli_transcript.py after.txt && diff before.txt after.txt

Each command runs as `python -m normswap ...` in a fresh process, in a scratch folder, without a terminal (no
progress bars), on the bundled demo model, tiny models built here from configs (GPT-2, BERT, ViT) and the
demo's text; temporary paths are written as <T>. The outputs are deterministic on one machine: run both
transcripts on the same one.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

TEXT = Path(__file__).resolve().parent.parent / "normswap" / "demo" / "heal.txt"


def tiny_models(root: Path) -> None:
    """The folders the commands read, built from configs with a fixed seed."""
    import torch
    import transformers as tf
    torch.manual_seed(0)
    models = {
        "gpt2": tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=101, n_positions=64)),
        "bert": tf.BertModel(tf.BertConfig(vocab_size=101, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)),
        "vit": tf.ViTModel(tf.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=64)),
    }
    for name, model in models.items():
        with torch.no_grad():   # far from init: a dropped bias shows
            for n, p in model.named_parameters():
                if "norm" in n.lower() or n.endswith(("ln_1.bias", "ln_2.bias", "ln_f.bias")):
                    p.add_(0.5 * torch.randn_like(p))
        model.save_pretrained(root / name)


def commands(t: Path) -> list[list[str]]:
    demo, text = "normswap-demo", str(TEXT)
    return [
        ["--version"], ["--help"], ["convert", "--help"],
        ["inspect", demo], ["inspect", demo, "--json"], ["inspect", str(t / "bert")],
        ["convert", demo, "--to", "rmsnorm", "-o", str(t / "exact")],
        ["convert", demo, "--to", "rmsnorm", "--method", "naive", "-o", str(t / "naive"), "--json"],
        ["convert", demo, "--to", "prmsnorm", "--p", "0.25", "-o", str(t / "p")],
        ["convert", str(t / "gpt2"), "--to", "rmsnorm", "--method", "exact", "-o", str(t / "g")],
        ["convert", str(t / "bert"), "--to", "rmsnorm", "--method", "exact", "-o", str(t / "b")],
        ["convert", str(t / "bert"), "--to", "rmsnorm", "-o", str(t / "b-auto"), "--json"],
        ["convert", str(t / "vit"), "--to", "rmsnorm", "--method", "exact", "-o", str(t / "v")],
        ["convert", demo, "--to", "rmsnorm", "-o", str(t / "exact")],                    # exists
        ["convert", demo, "-o", str(t / "x")],                                           # no --to
        ["convert", str(t / "missing"), "--to", "rmsnorm", "-o", str(t / "y")],
        ["convert", demo, "--to", "rmsnorm", "--p", "0.5", "-o", str(t / "z")],
        ["convert", demo, "--to", "rmsnorm", "--method", "exact", "--rotate", "-o", str(t / "rot")],
        ["inspect", str(t / "exact")], ["inspect", str(t / "exact"), "--json"],
        ["eval", str(t / "exact"), "--reference", demo, "--json"],
        ["eval", str(t / "naive"), "--reference", demo],
        ["generate", str(t / "exact"), "It is a truth universally", "--max-new-tokens", "8"],
        ["generate", str(t / "exact"), "It is", "--max-new-tokens", "4", "--json"],
        ["generate", str(t / "b"), "hello"],
        ["export", str(t / "exact"), "--onnx", str(t / "m.onnx")],
        ["export", str(t / "exact"), "-o", str(t / "deploy"), "--json"],
        ["export", str(t / "exact"), "--onnx", str(t / "m16.onnx"), "--dtype", "bf16"],
        ["rotate", str(t / "exact"), "-o", str(t / "rotated")],
        ["rotate", str(t / "naive"), "-o", str(t / "rotated2")],
        ["heal", str(t / "naive"), "--teacher", demo, "--data", text, "--steps", "3", "--seq-len", "32",
         "--batch-size", "2", "-o", str(t / "healed")],
        ["heal", str(t / "naive"), "--data", text, "--steps", "0", "-o", str(t / "h0")],
        ["plot", str(t / "healed"), "-o", str(t / "p.png")],
    ]


def normalised(text: str, t: Path) -> str:
    text = text.replace(str(t), "<T>").replace(os.path.realpath(t), "<T>")
    return re.sub(r"\b\d+(\.\d+)? ?(s|ms|sec|seconds)\b", "<time>", text)   # durations vary run to run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="Transcript file to write.")
    args = ap.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0", "COLUMNS": "120"}
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        tiny_models(t)
        for cmd in commands(t):
            run = subprocess.run([sys.executable, "-m", "normswap", *cmd], capture_output=True, text=True,
                                 env=env, cwd=t, stdin=subprocess.DEVNULL, timeout=900)
            lines += [f"$ normswap {normalised(' '.join(cmd), t)}", f"exit {run.returncode}",
                      "--- stdout", normalised(run.stdout, t).rstrip(),
                      "--- stderr", normalised(run.stderr, t).rstrip(), ""]
            print(f"{run.returncode} {' '.join(cmd)[:100]}", flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
