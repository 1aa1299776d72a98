"""Sample inputs for a model, built from its forward signature, its config (nested text, vision, audio,
backbone, encoder and decoder configs included) and the sizes its own embeddings expect: what the exact
plan traces and what verification compares on.

Several batches, so that every path that can write into the residual stream runs in at least one: the
first turns the optional inputs on (images, videos and audio with their tokens in multimodal decoders,
`bool_masked_pos`, token types, layout boxes), the second is a larger batch with right-padded rows
(and text alone where those are optional). A model whose main input is text gets a third batch, one row
as long as its config allows (`max_position_embeddings`, `n_positions`...; fewer where its position table
starts after a padding row), capped at `text.LONGEST` = 512 tokens to stay cheap: a path only long inputs
take (a branch on the length, a table added from some length on) runs too. No row is longer than 512; a
parameter or buffer that only longer inputs would run is refused by the exact plan as never run. A config
that states no position limit (relative positions: T5) gets no such row. Where a guess needs the model's word
(how many image tokens one image fills) a trial forward corrects it; an optional input the model then
rejects is left out, and a long row it rejects too. Where no input can be built, a one-line NormswapError
names what is missing.
"""
from __future__ import annotations

import torch
from torch import nn

from normswap.errors import NormswapError, first_line
from normswap.models.inputs import audio, media, series, text, vision
from normswap.models.inputs.context import DECODER, Ctx, nested_configs
from normswap.models.inputs.runs import run, run_either, runs_on_meta

MAINS = ("input_ids", "pixel_values", "pixel_values_videos", "input_features", "input_values", "past_values",
         "states")
# inputs that only switch an optional path on
OPTIONAL = ("bool_masked_pos", "bbox", "token_type_ids", "noise", "encoder_hidden_states", "encoder_outputs")
def sample_inputs(model: nn.Module, batch: int = 2, seq: int = 16, seed: int = 0) -> list[dict]:
    """A few deterministic input batches for `model` (see the module docstring), on its device, floating
    inputs in its dtype. The first is small (batch 1 where there is text) and turns optional paths on."""
    ctx = Ctx(model, batch, seq, seed)
    try:
        batches = build(ctx)
    except NormswapError:
        raise
    except Exception as e:   # a config this code misreads: say so in one line, not a traceback
        raise ctx.refuse(f"{type(e).__name__}: {first_line(e, strip=True)}") from None
    return [{k: v.to(ctx.device) if isinstance(v, torch.Tensor) else v for k, v in x.items()} for x in batches]


def main_inputs(ctx: Ctx) -> list[str]:
    """The model's main inputs; where its main_input_name is not in its forward (a vision tower that kept
    the default "input_ids"), the first input its forward takes that normswap knows how to build."""
    if vision.grid_tower(ctx):   # patches with their grid: under whichever name the tower reads them
        return ["pixel_values" if ctx.has("pixel_values") else "hidden_states"]
    names = getattr(ctx.model, "main_input_name", "input_ids")
    names = [n for n in ([names] if isinstance(names, str) else list(names)) if n in ctx.params] or \
        [next((n for n in [*ctx.required(), *ctx.params] if n in MAINS), names)]
    unknown = [n for n in names if n not in MAINS]
    if unknown:
        raise ctx.refuse(f"its main input `{unknown[0]}` is not one normswap can build (it builds "
                         f"{', '.join(MAINS)})")
    return names


def build(ctx: Ctx) -> list[dict]:
    mains = main_inputs(ctx)
    wide = text.length(ctx, 2 * ctx.seq + 1) if ctx.has("input_ids") else ctx.seq
    tokens = ctx.has("input_ids") or ctx.has("decoder_input_ids")
    shapes = [(1 if tokens else ctx.batch, min(ctx.seq, wide), True), (ctx.batch, wide, False)]
    batches = [one(ctx, mains, b, s, first) for b, s, first in shapes]
    for key in media.MEDIA:
        batches = media.media_tokens(ctx, batches, mains, key)
    batches = [without_rejected(ctx, other_layout(ctx, images_apart(ctx, x))) for x in batches]
    if vision.grid_tower(ctx):
        batches = grid_shape(ctx, batches, mains[0])
    if signature(batches[0]) == signature(batches[1]):   # nothing optional, no text: one batch does
        batches = batches[1:]
    missing = [r for r in ctx.required() if r not in batches[0]]
    if missing:
        raise ctx.refuse(f"no sample for its required input{'s' * (len(missing) > 1)} "
                         f"{', '.join(f'`{m}`' for m in missing)}")
    long = longer(ctx, mains, batches[-1])
    return batches + ([long] if long is not None else [])


def longer(ctx: Ctx, mains: list[str], last: dict) -> dict | None:
    """One row of text as long as the model takes (`text.longest`), where that is longer than `last` (the
    last batch): with the optional inputs `last` kept, and no media spliced in at tokens. None where there is
    none, or where the model, with weights here, does not run on it."""
    n = text.longest(ctx) if "input_ids" in mains and "input_ids" in last else None
    if n is None or n <= last["input_ids"].shape[-1]:
        return None
    x = one(ctx, mains, 1, n, first=False)
    if any(key in x and token_of(ctx) is not None for key, (_, token_of) in media.MEDIA.items()):
        return None
    x = {k: v for k, v in x.items() if k in last or k not in OPTIONAL}
    return None if ctx.runnable and run(ctx.model, x) else x


def signature(x: dict) -> dict:
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else signature(dict(enumerate(v)))
            if isinstance(v, tuple) else v for k, v in x.items()}


def takes_images(ctx: Ctx, mains: list[str]) -> bool:
    return "pixel_values" in mains or ctx.has("pixel_values") and "pixel_values" in ctx.required() or \
        ctx.has("pixel_values") and (ctx.has("input_ids") or ctx.has("bbox"))


def one(ctx: Ctx, mains: list[str], b: int, s: int, first: bool) -> dict:
    """One batch: b rows of s tokens (or one image, clip, waveform... per row); `first` turns optional
    paths on, else rows are right-padded."""
    x: dict = {}
    required = set(ctx.required())
    if ctx.has("input_ids") and ("input_ids" in mains or "input_ids" in required or ctx.integer("vocab_size")):
        text.text(ctx, x, b, s, padded=not first)
    text.side_text(ctx, x, b, s, padded=not first)
    token = vision.image_token(ctx)
    if takes_images(ctx, mains):
        optional = "pixel_values" not in mains and "pixel_values" not in required
        # a decoder that splices image tokens into its text reads text alone too: the second batch
        if not (token is not None and optional and not first):
            x["pixel_values"] = vision.pixels(ctx, b, video=vision.frames(ctx) is not None)
    if grid := vision.grid_tower(ctx):
        x[mains[0]], x[grid] = vision.grid_patches(ctx, b, wide=not first)
        if ctx.has("merge_sizes"):   # Video-LLaMA 3: each image's merge
            x["merge_sizes"] = vision.merges(ctx, b)
    if "pixel_values" in x and ctx.has("spatial_shapes") and (flex := vision.naflex(ctx, b, wide=not first)):
        x["pixel_values"], x["pixel_attention_mask"], x["spatial_shapes"] = flex
    if "pixel_values" in x and ctx.has("high_res_pixel_values") and (high := vision.high_res(ctx, b)) is not None:
        x["high_res_pixel_values"] = high
    if "pixel_values" in x and ctx.has("target_sizes") and (strip := vision.packed(ctx, b)):
        x["pixel_values"], x["target_sizes"] = strip
    if ctx.has("pixel_values_videos") and ("pixel_values_videos" in mains or "pixel_values_videos" in required or
                                           first and "input_ids" in x and vision.video_token(ctx) is not None):
        x["pixel_values_videos"] = vision.pixels(ctx, b, video=True)
    if ctx.passes_on("bool_masked_pos") and ("pixel_values" in x or "pixel_values_videos" in x) and \
            (first and vision.reads_masks(ctx) or "bool_masked_pos" in required):
        x["bool_masked_pos"] = vision.masked_positions(ctx, b)
    if ctx.has("noise") and "pixel_values" in x and (n := vision.noise(ctx, b)) is not None:
        x["noise"] = n
    if "pixel_values" in x and "input_ids" in x and ctx.has("image_embeds_position_mask"):
        x = media.placed_images(ctx, x)
    x.update(vision.regions(ctx, b))
    if "input_features" in mains or "input_features" in required or \
            first and "input_ids" in x and ctx.has("input_features") and audio.audio_token(ctx) is not None:
        x["input_features"] = audio.features(ctx, b, s)
        for mask in (m for m in audio.FRAME_MASKS if ctx.has(m)):   # every frame real
            x[mask] = audio.frames_mask(ctx, x["input_features"])
    if "input_values" in mains or "input_values" in required:
        x["input_values"] = audio.values(ctx, b, s)
        if ctx.has("attention_mask") and "input_ids" not in x and x["input_values"].dim() == 2:
            x["attention_mask"] = text.padded_mask(b, x["input_values"].shape[-1], padded=not first)
    if "past_values" in mains:
        series.series(ctx, x, b)
    if "states" in mains:
        series.trajectory(ctx, x, b, padded=not first)
    if ctx.has("decoder_input_ids") and (encoder_decoder(ctx) or "decoder_input_ids" in required):
        text.decoder(ctx, x, b, s)
    if first and (name := cross_attends(ctx)):   # its own generator: trying it must not shift the other draws
        width = ctx.integer("cross_attention_hidden_size", "hidden_size", "d_model", "n_embd", prefer=DECODER)
        g = torch.Generator().manual_seed(ctx.seed + 1)
        states = torch.randn(b, max(2, s // 2 + 1), width, generator=g).to(ctx.device, ctx.dtype)
        states = states if name == "encoder_hidden_states" else (states,)
        plain = {k: v for k, v in x.items() if k != "attention_mask"}   # masks are checked by value (.item())
        if ctx.runnable or ctx.value("add_cross_attention") or runs_on_meta(ctx, {**plain, name: states}):
            x[name] = states
    for name in mains:
        if name not in x:
            raise ctx.refuse(f"cannot build its main input `{name}` from the config")
    return x


def grid_shape(ctx: Ctx, batches: list[dict], name: str) -> list[dict]:
    """The batches with their patches in the first shape the tower runs on (see `vision.patch_shapes`), tried
    with the weights, or on the meta device when converting lazily; as built where none runs (its error says why)."""
    options = [vision.patch_shapes(ctx, x[name]) for x in batches]
    for k in range(len(options[0])):
        shaped = [{**x, name: shapes[k]} for x, shapes in zip(batches, options)]
        if not run_either(ctx, shaped[0]):
            return shaped
    return batches


def images_apart(ctx: Ctx, x: dict) -> dict:
    """x with its images as (batch, images, channels, h, w) and every token attending to them, for a model
    that reads an `image_attention_mask` (Idefics' cross-attention to its images) and runs on that and not
    on x (see `first_that_runs`)."""
    if not ctx.has("image_attention_mask") or "input_ids" not in x or x.get("pixel_values") is None or \
            x["pixel_values"].dim() != 4:
        return x
    return first_that_runs(ctx, x, [{**x, "pixel_values": x["pixel_values"][:, None],
                                      "image_attention_mask": torch.ones(*x["input_ids"].shape, 1, dtype=torch.long)}])


def other_layout(ctx: Ctx, x: dict) -> dict:
    """x with its waveform as (batch, 1, samples) (OmniASR's front end reads a channel axis it does not add), or
    its audio features' last two axes swapped (a 2-D convolution over a spectrogram reads either order), where
    the model runs on that and not on x (see `first_that_runs`)."""
    others = []
    if (wave := x.get("input_values")) is not None and wave.dim() == 2:
        others.append({**x, "input_values": wave[:, None]})
    # not where the first convolution settles it: Whisper's 30 s of features cost a forward of seconds to try
    if (feats := x.get("input_features")) is not None and feats.dim() == 3 and not audio.mels_as_channels(ctx):
        others.append({**x, "input_features": feats.transpose(1, 2).contiguous()})
    return first_that_runs(ctx, x, others)


def first_that_runs(ctx: Ctx, x: dict, others: list[dict]) -> dict:
    """x if the model runs on it (or on none of `others`), else the first of `others` it runs on: with its
    weights, or on a meta skeleton when converting lazily. No forward where there is nothing else to try."""
    if not others or not run_either(ctx, x):
        return x
    return next((y for y in others if not run_either(ctx, y)), x)


def without_rejected(ctx: Ctx, x: dict) -> dict:
    """x, less the optional path switches (masks over patches, boxes, token types) if the model, with
    weights here, fails on them and runs without them."""
    extras = [k for k in OPTIONAL if k in x and k not in ctx.required()]
    if not extras or not ctx.runnable or not run(ctx.model, x):
        return x
    plain = {k: v for k, v in x.items() if k not in extras}
    return x if run(ctx.model, plain) else plain


def cross_attends(ctx: Ctx) -> str | None:
    """The input to pass encoder states in, for a decoder run alone that can attend to them: MusicGen's
    decoder and GPT-2 with cross-attention (`encoder_hidden_states`), Whisper's decoder as a causal LM
    (`encoder_outputs`); the first batch passes some, so its cross-attention norms run. Where the config
    does not say so, a model with weights here is tried (`without_rejected` drops them if it refuses them),
    one without (a lazy conversion) on the meta device."""
    if "input_ids" not in ctx.params or ctx.has("decoder_input_ids"):   # not a decoder alone
        return None
    if ctx.has("encoder_hidden_states") and not encoder_decoder(ctx):
        return "encoder_hidden_states"
    return "encoder_outputs" if ctx.has("encoder_outputs") else None


def encoder_decoder(ctx: Ctx) -> bool:
    return any(getattr(c, "is_encoder_decoder", False) for c in nested_configs(ctx.config))
