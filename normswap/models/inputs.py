"""Sample inputs for a model, built from its forward signature and config: what the exact plan traces and
what verification compares on."""
from __future__ import annotations

import inspect

import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.models.introspect import config_value


def _ids(config, shape, g, start: int | None = None) -> torch.Tensor:
    ids = torch.randint(0, config_value(config, "vocab_size"), shape, generator=g)
    if start is not None:
        ids[:, 0] = start
    return ids


def _length(config, seq: int, *keys: str) -> int:
    limits = [v for k in keys if isinstance(v := config_value(config, k), int) and v > 0]   # XLNet: -1, no limit
    return min([seq, *limits])


def sample_inputs(model: nn.Module, batch: int = 2, seq: int = 16, seed: int = 0) -> list[dict]:
    """A few deterministic inputs built from `model`'s signature and config: token ids (with a
    right-padded batch), pixel values, Whisper- or Speech2Text-style features, wav2vec2-style waveforms,
    and decoder ids for encoder-decoders (starting with decoder_start_token_id)."""
    config = model.config
    g = torch.Generator().manual_seed(seed)
    ref = next(model.parameters())
    device, dtype = ref.device, ref.dtype if ref.is_floating_point() else torch.float32
    params = inspect.signature(model.forward).parameters
    main = getattr(model, "main_input_name", "input_ids")
    if main not in ("input_ids", "pixel_values", "input_features", "input_values"):
        raise NormswapError(f"cannot build sample inputs for a model whose main input is '{main}'")
    if main == "input_values" and not (config_value(config, "conv_kernel") and config_value(config, "conv_stride")):
        raise NormswapError("cannot build sample inputs: input_values without conv_kernel/conv_stride "
                            "(not wav2vec2-like)")
    text = "input_ids" in params and main == "input_ids"
    # CLIP-like: text and image side by side (not a model that splices image tokens into the text)
    two_towers = ("pixel_values" in params and config_value(config, "image_size") is not None
                  and all(getattr(config, k, None) is None for k in ("image_token_id", "image_token_index")))
    if main == "input_features" and config_value(config, "num_mel_bins") is None and \
            config_value(config, "input_feat_per_channel") is None:
        raise NormswapError("cannot build sample inputs: input_features without num_mel_bins (Whisper) or "
                            "input_feat_per_channel (Speech2Text)")
    seq2seq = bool(getattr(config, "is_encoder_decoder", False)) and "decoder_input_ids" in params
    n = _length(config, seq * 2 + 1, "max_position_embeddings", "n_positions")
    out = []
    # a single and a padded batch where there is text or a decoder; one batch of images or audio otherwise
    for b, s in ((1, seq), (batch, n)) if text or seq2seq else ((batch, seq),):
        s = min(s, n)
        x: dict = {}
        if text:
            x["input_ids"] = _ids(config, (b, s), g)
            x["attention_mask"] = torch.ones(b, s, dtype=torch.long)
            if b > 1:
                x["attention_mask"][1:, s // 2:] = 0   # right-padded rows: padding must not matter
        if main == "pixel_values" or two_towers:
            size = config_value(config, "image_size")
            h, w = (size, size) if isinstance(size, int) else tuple(size)[-2:]
            x["pixel_values"] = torch.randn(b, config_value(config, "num_channels", 3), h, w, generator=g).to(dtype)
        if main == "input_features" and config_value(config, "num_mel_bins") is not None:
            # Whisper: (batch, mel bins, 2 * encoder positions)
            frames = 2 * config_value(config, "max_source_positions", 1500)
            x["input_features"] = torch.randn(b, config_value(config, "num_mel_bins"), frames, generator=g).to(dtype)
        elif main == "input_features":   # Speech2Text: (batch, frames, features), frames halved per conv
            frames = 2 ** config_value(config, "num_conv_layers", 2) * _length(config, s, "max_source_positions")
            width = config_value(config, "input_feat_per_channel") * config_value(config, "input_channels", 1)
            x["input_features"] = torch.randn(b, frames, width, generator=g).to(dtype)
        if main == "input_values":   # wav2vec2: a waveform the conv feature encoder turns into s frames
            n = s
            for k, st in reversed(list(zip(config_value(config, "conv_kernel"), config_value(config, "conv_stride")))):
                n = (n - 1) * st + k
            x["input_values"] = torch.randn(b, n, generator=g).to(dtype)
        if seq2seq:   # as long as the encoder input: compare's mask then covers both
            start = getattr(config, "decoder_start_token_id", None)
            d = _length(config, s, "max_target_positions", "max_position_embeddings")
            x["decoder_input_ids"] = _ids(config, (b, d), g, start)
            if d != s:
                x.pop("attention_mask", None)
        out.append({k: v.to(device) for k, v in x.items()})
    return out
