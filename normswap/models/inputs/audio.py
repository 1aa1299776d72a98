"""Speech and audio inputs: log-mel features (Whisper, Speech2Text), waveforms sized for a conv feature
encoder (wav2vec2 family), spectrogram patches without one (AST), raw waveforms for encoders with their
own convolutional front end (Moonshine) and codecs' (batch, channels, samples)."""
from __future__ import annotations

import torch
from torch import nn

from normswap.models.inputs.context import AUDIO, Ctx

WHISPER_POSITIONS = 1500   # Whisper's 30 s window, where the config names no encoder positions
WAVEFORM = 4000   # samples (a quarter second at 16 kHz) where the config names no conv stack
FRAME_MASKS = ("input_features_mask", "feature_attention_mask")   # masks over an audio input's frames


def features(ctx: Ctx, b: int, s: int) -> torch.Tensor:
    """input_features: Whisper-style (b, mel bins, 2 x encoder positions), FastConformer-style (b, frames,
    mel bins), frames the subsampling factor times s, or Speech2Text-style (b, frames, features), frames
    halved by each conv layer."""
    mels, form = ctx.integer("num_mel_bins", prefer=AUDIO), layout(ctx)
    window = 2 * ctx.integer("n_window", prefer=AUDIO, default=1)   # Qwen3-ASR reads whole windows of frames
    if form == "frames, mels":   # FastConformer (Parakeet, Canary, LASR)
        frames = ctx.integer("subsampling_factor", prefer=AUDIO, default=4) * s
        return ctx.randn(b, -(-frames // window) * window, mels)
    if form == "mels, frames":
        positions = ctx.integer("max_source_positions", prefer=AUDIO, default=WHISPER_POSITIONS)
        return ctx.randn(b, mels, -(-2 * positions // window) * window)
    width = ctx.integer("input_feat_per_channel", "feature_projection_input_dim", prefer=AUDIO)
    if width is None:
        raise ctx.refuse("`input_features` without num_mel_bins (Whisper) or input_feat_per_channel (Speech2Text)")
    limit = ctx.integer("max_source_positions", prefer=AUDIO, default=s)
    frames = 2 ** ctx.integer("num_conv_layers", default=1) * min(s, limit)
    return ctx.randn(b, frames, width * ctx.integer("input_channels", default=1))


def layout(ctx: Ctx) -> str:
    """How input_features hold their values after the batch: "mels, frames" (Whisper: the model's first
    convolution reads the mel bins as its channels), "frames, mels" (a 2-D convolution over them, or one
    after a linear layer: FastConformer), or "frames, features" (Speech2Text, no num_mel_bins)."""
    mels = ctx.integer("num_mel_bins", prefer=AUDIO)
    if mels is None or ctx.integer("input_feat_per_channel") is not None:
        return "frames, features"
    return "mels, frames" if mels_as_channels(ctx) or first_conv(ctx) is None else "frames, mels"


def first_conv(ctx: Ctx) -> nn.Module | None:
    """The model's first 1-D or 2-D convolution: what reads a spectrogram."""
    return next((m for m in (ctx.module.modules() if ctx.module is not None else ())
                 if isinstance(m, (nn.Conv1d, nn.Conv2d))), None)


def mels_as_channels(ctx: Ctx) -> bool:
    """Whether the first convolution reads the mel bins as its channels (Whisper): the layout is settled. A
    2-D one reads the spectrogram as an image, in either axis order (FastConformer: frames first; Qwen3-ASR:
    mels first), and a linear layer first (Nemotron's audio encoders) either; only a trial tells those."""
    first, mels = first_conv(ctx), ctx.integer("num_mel_bins", prefer=AUDIO)
    return isinstance(first, nn.Conv1d) and first.in_channels == mels


def values(ctx: Ctx, b: int, s: int) -> torch.Tensor:
    """input_values: a waveform that a wav2vec2-style conv feature encoder turns into s frames; AST's
    (b, max_length, mel bins) spectrogram; codecs' (b, channels, samples); else a raw waveform."""
    kernels, strides = ctx.value("conv_kernel", prefer=AUDIO), ctx.value("conv_stride", prefer=AUDIO)
    if kernels and strides:
        n = s
        for k, st in reversed(list(zip(kernels, strides))):
            n = (n - 1) * st + k
        return ctx.randn(b, n)
    mels, frames = ctx.integer("num_mel_bins", prefer=AUDIO), ctx.integer("max_length", prefer=AUDIO)
    if mels is not None and frames is not None:   # AST: a spectrogram cut into patches
        return ctx.randn(b, frames, mels)
    audio_channels = ctx.integer("audio_channels", prefer=AUDIO)
    if audio_channels is not None:
        return ctx.randn(b, audio_channels, WAVEFORM)
    return ctx.randn(b, WAVEFORM)


def audio_token(ctx: Ctx) -> int | None:
    """The token an audio-language model (Qwen2-Audio, Audio Flamingo, GLM-ASR...) splices audio features at."""
    return ctx.integer("audio_token_id", "audio_token_index", minimum=0)


def frames_mask(ctx: Ctx, feats: torch.Tensor) -> torch.Tensor:
    """All frames of `feats` (built by `features`) valid: (b, frames)."""
    frames = feats.shape[-1] if layout(ctx) == "mels, frames" else feats.shape[1]
    return torch.ones(feats.shape[0], frames, dtype=torch.long)
