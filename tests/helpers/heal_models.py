"""Tiny models and tokenizers built from configs for the heal/evaluate tests (no Hub, no demo weights)."""
from __future__ import annotations

import random

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

WORDS = ("the a she he it was not of to and in that her his had but with for at be as by on so very "
         "Emma Anne Elliot Mr Mrs Miss Captain Wentworth Bath letter walk house sister friend said "
         "would could should might never always little great good young happy felt thought").split()


def text(n_words: int = 3000, seed: int = 0) -> str:
    """Pseudo-English with sentence ends, reproducible."""
    rng = random.Random(seed)
    out = []
    for i in range(n_words):
        w = rng.choice(WORDS)
        out.append(w.capitalize() if i == 0 or out[-1].endswith(".") else w)
        if rng.random() < 0.1:
            out[-1] += "."
    return " ".join(out) + "."


def tokenizer(bert: bool = False, vocab: int = 160) -> PreTrainedTokenizerFast:
    specials = ["[PAD]", "[CLS]", "[SEP]", "[UNK]"] if bert else ["<eos>"]
    tok = Tokenizer(models.BPE(unk_token="[UNK]" if bert else None))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([text()], trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                                                show_progress=False))
    if bert:
        return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", cls_token="[CLS]",
                                       sep_token="[SEP]", unk_token="[UNK]")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<eos>")


def perturb_norms(model: torch.nn.Module, seed: int = 1, scale: float = 0.5) -> None:
    """Give every LayerNorm a non-trivial gain and bias, so that the naive swap changes the model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.copy_(1 + scale * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(scale * torch.randn(m.bias.shape, generator=g))


def gpt2(vocab: int, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.transformer.wte.weight.mul_(10)  # peakier next-token distributions than the 0.02 init
    perturb_norms(model)
    return model


def bert(vocab: int, seed: int = 0) -> BertModel:
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    model = BertModel(config, add_pooling_layer=False).eval()
    perturb_norms(model)
    return model


def save_pair(d, tok, train_text: str):
    """d/orig (a GPT-2 with perturbed norms), d/conv (its naive conversion), d/train.txt: heal's inputs."""
    import copy

    import normswap
    teacher = gpt2(len(tok))
    student = copy.deepcopy(teacher)
    normswap.convert(student, method="naive")
    normswap.save_pretrained(teacher, d / "orig", tokenizer=tok)
    normswap.save_pretrained(student, d / "conv", tokenizer=tok)
    (d / "train.txt").write_text(train_text)
    return d
