"""Train the bundled demo model `normswap-demo` on the Austen corpus (CPU, ~30 min on 2 cores).

    python examples/train_demo_model.py --corpus ../shared/corpora/austen --out normswap/demo

Recipe: byte-level BPE (8192 tokens) trained on the training split; GPT-2 architecture,
4 layers, 256 wide, 4 heads, 128 positions (= the training window), tied embeddings; AdamW (lr 1e-3, betas 0.9/0.95,
wd 0.1), 100 warm-up steps then cosine to 1e-4; batches of 32 x 128 tokens; fp32 training,
fp16 storage. Persuasion chapters 21-24 are held out (see normswap/demo.py).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from normswap.models.demo import split_corpus

EOS = "<|endoftext|>"


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS,
                                   unk_token=EOS, model_max_length=128)


def encode(tokenizer, texts: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def heldout_perplexity(model, ids: torch.Tensor, seq: int) -> float:
    model.eval()
    n = (len(ids) - 1) // seq * seq
    x, y = ids[:n].view(-1, seq), ids[1 : n + 1].view(-1, seq)
    nll = sum(torch.nn.functional.cross_entropy(model(xb).logits.flatten(0, 1), yb.flatten(), reduction="sum").item()
              for xb, yb in zip(x.split(16), y.split(16)))
    model.train()
    return math.exp(nll / y.numel())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="../shared/corpora/austen")
    ap.add_argument("--out", default="normswap/demo")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)

    train_texts, heldout = split_corpus(args.corpus)
    tokenizer = train_tokenizer(train_texts, args.vocab)
    train_ids, held_ids = encode(tokenizer, train_texts), encode(tokenizer, [heldout])
    print(f"train tokens {len(train_ids):,}  held-out tokens {len(held_ids):,}", flush=True)

    # n_positions = the training window, so that every position is trained.
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=args.seq, n_embd=256, n_layer=4, n_head=4,
                        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                        tie_word_embeddings=True)
    model = GPT2LMHeadModel(config)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warmup, floor = 100, 0.1

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        t = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))

    t0 = time.time()
    for step in range(args.steps):
        starts = torch.randint(0, len(train_ids) - args.seq - 1, (args.batch,))
        x = torch.stack([train_ids[s : s + args.seq] for s in starts])
        y = torch.stack([train_ids[s + 1 : s + args.seq + 1] for s in starts])
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            msg = f"step {step:5d}  loss {loss.item():.3f}  {time.time() - t0:6.0f}s"
            if step % 500 == 0 or step == args.steps - 1:
                msg += f"  held-out ppl {heldout_perplexity(model, held_ids, args.seq):.2f}"
            print(msg, flush=True)

    ppl = heldout_perplexity(model.half().float(), held_ids, args.seq)  # as stored (fp16)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".demo-"))
    model.half().save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "heldout.txt").write_text(heldout, encoding="utf-8")
    recipe = dict(vars(args), heldout_perplexity_fp16=round(ppl, 3), train_tokens=len(train_ids),
                  heldout_tokens=len(held_ids), seconds=round(time.time() - t0))
    (tmp / "training.json").write_text(json.dumps(recipe, indent=2) + "\n")
    for f in tmp.iterdir():
        shutil.move(str(f), out / f.name)
    tmp.rmdir()
    print(f"held-out perplexity (fp16 weights, {args.seq}-token windows): {ppl:.2f}  -> {out}")


if __name__ == "__main__":
    main()
