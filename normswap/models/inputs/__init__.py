"""Sample inputs for a model, built from its forward signature, its config (nested text, vision, audio,
backbone, encoder and decoder configs included) and the sizes its own embeddings expect: what the exact
plan traces and what verification compares on.

Several batches, so that every path that can write into the residual stream runs in at least one: the
first turns the optional inputs on (images, videos and audio with their tokens in multimodal decoders,
`bool_masked_pos`, token types, layout boxes), the second is a larger batch with right-padded rows
(and text alone where those are optional). Where a guess needs the model's word (how many image tokens
one image fills) a trial forward corrects it; an optional input the model then rejects is left out.
Where no input can be built, a one-line NormswapError names what is missing.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.models.inputs import audio, series, text, vision
from normswap.models.inputs.context import DECODER, Ctx, nested_configs

MAINS = ("input_ids", "pixel_values", "pixel_values_videos", "input_features", "input_values", "past_values",
         "states")
# inputs that only switch an optional path on
OPTIONAL = ("bool_masked_pos", "bbox", "token_type_ids", "noise", "encoder_hidden_states", "encoder_outputs")
# how many tiles of one image the model expected (LLaVA-NeXT splits its pixel values per image)
TILES = re.compile(r"split_sizes to sum exactly to \d+ .*got split_sizes=\[(\d+)")
# what the model reports when the image (video, audio) tokens in the text do not match its features
MISMATCH = re.compile(r"(?:image|video|audio) tokens do not match\W+tokens\W+(\d+)\W+features\W+(\d+)", re.I)
# a decoder's inputs that it splices into its text at their tokens: input -> (what they are, their token)
MEDIA = {"pixel_values": ("image", vision.image_token), "pixel_values_videos": ("video", vision.video_token),
         "input_features": ("audio", audio.audio_token)}
# masks over an audio input's frames
FRAME_MASKS = ("input_features_mask", "feature_attention_mask")


def sample_inputs(model: nn.Module, batch: int = 2, seq: int = 16, seed: int = 0) -> list[dict]:
    """A few deterministic input batches for `model` (see the module docstring), on its device, floating
    inputs in its dtype. The first is small (batch 1 where there is text) and turns optional paths on."""
    ctx = Ctx(model, batch, seq, seed)
    try:
        batches = build(ctx)
    except NormswapError:
        raise
    except Exception as e:   # a config this code misreads: say so in one line, not a traceback
        raise ctx.refuse(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}") from None
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
    for key in MEDIA:
        batches = media_tokens(ctx, batches, mains, key)
    batches = [without_rejected(ctx, x) for x in batches]
    if vision.grid_tower(ctx):
        batches = grid_shape(ctx, batches, mains[0])
    if signature(batches[0]) == signature(batches[1]):   # nothing optional, no text: one batch does
        batches = batches[1:]
    missing = [r for r in ctx.required() if r not in batches[0]]
    if missing:
        raise ctx.refuse(f"no sample for its required input{'s' * (len(missing) > 1)} "
                         f"{', '.join(f'`{m}`' for m in missing)}")
    return batches


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
    if ctx.has("pixel_values_videos") and ("pixel_values_videos" in mains or "pixel_values_videos" in required or
                                           first and "input_ids" in x and vision.video_token(ctx) is not None):
        x["pixel_values_videos"] = vision.pixels(ctx, b, video=True)
    if ctx.passes_on("bool_masked_pos") and ("pixel_values" in x or "pixel_values_videos" in x) and \
            (first and vision.reads_masks(ctx) or "bool_masked_pos" in required):
        x["bool_masked_pos"] = vision.masked_positions(ctx, b)
    if ctx.has("noise") and "pixel_values" in x and (n := vision.noise(ctx, b)) is not None:
        x["noise"] = n
    if "input_features" in mains or "input_features" in required or \
            first and "input_ids" in x and ctx.has("input_features") and audio.audio_token(ctx) is not None:
        x["input_features"] = audio.features(ctx, b, s)
        for mask in (m for m in FRAME_MASKS if ctx.has(m)):   # every frame real
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
    with the weights, or on the meta device when streaming; as built where none runs (its error says why)."""
    options = [vision.patch_shapes(ctx, x[name]) for x in batches]
    for k in range(len(options[0])):
        shaped = [{**x, name: shapes[k]} for x, shapes in zip(batches, options)]
        if not run_either(ctx, shaped[0]):
            return shaped
    return batches


def run_either(ctx: Ctx, x: dict) -> str:
    """The model's error on `x` ("" if it runs): with its weights, else on a meta skeleton."""
    if ctx.runnable:
        return run(ctx.model, x)
    return "" if runs_on_meta(ctx, x) else "does not run on the meta device"


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
    one without (streaming) on the meta device."""
    if "input_ids" not in ctx.params or ctx.has("decoder_input_ids"):   # not a decoder alone
        return None
    if ctx.has("encoder_hidden_states") and not encoder_decoder(ctx):
        return "encoder_hidden_states"
    return "encoder_outputs" if ctx.has("encoder_outputs") else None


def encoder_decoder(ctx: Ctx) -> bool:
    return any(getattr(c, "is_encoder_decoder", False) for c in nested_configs(ctx.config))


def media_tokens(ctx: Ctx, batches: list[dict], mains: list[str], key: str) -> list[dict]:
    """Batches of a model that splices image (audio) features into its text at image (audio) tokens get
    those tokens. How many one image fills is guessed from the config, then, where the model has weights
    here, checked by a trial forward that takes the count the model reports, and the form of the images it
    wants (flattened patches: Fuyu; an images axis: Idefics; each image's size and its tiles: LLaVA-NeXT;
    patches with their grid: Qwen-VL). Optional inputs the model cannot read are left out: their path then
    stays untraced."""
    kind, token_of = MEDIA[key]
    token = token_of(ctx)
    todo = [i for i, x in enumerate(batches) if token is not None and key in x and "input_ids" in x]
    if not todo:
        return batches
    n = (vision.image_tokens_per_image(ctx) or 1) if kind == "image" else 1
    if not ctx.runnable:   # a guess no forward has checked would trace (and verify) another path
        raise ctx.refuse(f"how many {kind} tokens one {kind} fills is checked by a trial forward, which needs "
                         "the weights")
    later = list(MEDIA)[list(MEDIA).index(key) + 1:]   # not spliced yet: left out of this trial
    found, error = trial(ctx, {k: v for k, v in batches[todo[0]].items() if k not in later}, token, n, key)
    if found is None:
        if key in mains or key in ctx.required():
            raise ctx.refuse(f"{kind}s with {kind} tokens: the model refused every form tried ({error})")
        return [{k: v for k, v in x.items() if k != key} for x in batches]
    form, n = found
    return [spliced(ctx, x, token, n, form) if i in todo else x for i, x in enumerate(batches)]


def trial(ctx: Ctx, x: dict, token: int, n: int, key: str) -> tuple[tuple[str, int] | None, str]:
    """((form of the `key` input, tokens per item), "") that the model runs with, or (None, its last error)."""
    error = ""
    hidden = ctx.integer("hidden_size", "d_model", prefer=("text_config",), default=1)
    if key != "pixel_values":   # videos and audio as built
        forms = ["as built"]
    elif ctx.has("image_grid_thw"):   # one list of patches in each shape a tower reads (vision.patch_shapes)
        forms = ["grid:0", "grid:1", "grid:2"]
    else:
        forms = ["as built", "patches", "per image"] + ["sized"] * ctx.has("image_sizes")
    for form in forms:
        counts, tried = [n], set()
        while counts:
            count = counts.pop(0)
            y = spliced(ctx, x, token, count, form) if count not in tried else None
            if y is None:
                continue
            tried.add(count)
            error = run(ctx.model, y)
            if not error:
                return (form, count), ""
            if m := MISMATCH.search(error):   # features reported per token, or (some models) per value
                b, f = len(y[key]), int(m.group(2))
                counts += [c // b for c in (f, f // hidden) if c % b == 0 and c >= b and c // b not in tried]
            if (m := TILES.search(error)) and f"tiles:{m.group(1)}" not in forms:   # tiles per image it wants
                forms.append(f"tiles:{m.group(1)}")
    return None, error


def spliced(ctx: Ctx, x: dict, token: int, n: int, form: str) -> dict | None:
    """x with n image (video, audio) tokens after the first token of every row (masks and token types grow
    with them), its images in the given form."""
    y = dict(x)
    b = y["input_ids"].shape[0]
    if form.startswith("grid:"):   # Qwen-VL: one list of patches, each image's grid, the tokens it merges into
        patches, y["image_grid_thw"] = vision.grid_patches(ctx, len(x["pixel_values"]), wide=False)
        shapes = vision.patch_shapes(ctx, patches)
        if int(form[5:]) >= len(shapes):
            return None
        y["pixel_values"] = shapes[int(form[5:])]
        n = int(y["image_grid_thw"][0].prod()) // vision.merge(ctx) ** 2
        if ctx.has("image_merge_sizes"):   # Video-LLaMA 3: each image's merge
            y["image_merge_sizes"] = vision.merges(ctx, len(y["image_grid_thw"]))
    elif form == "patches":
        y["pixel_values"] = vision.flat_patches(ctx, len(x["pixel_values"]))
        if y["pixel_values"] is None:
            return None
    elif form == "per image":   # (batch, images, channels, h, w): Idefics
        y["pixel_values"] = x["pixel_values"][:, None]
    elif form.startswith("tiles:"):   # (batch, tiles, channels, h, w): LLaVA-NeXT's tiles of each image
        y["pixel_values"] = x["pixel_values"][:, None].expand(-1, int(form[6:]), -1, -1, -1).contiguous()
    if form == "sized" or form.startswith("tiles:"):   # each image's (height, width): LLaVA-NeXT tiles by them
        y["image_sizes"] = torch.tensor([list(vision.image_size(ctx))] * len(x["pixel_values"]))
    for key, fill in (("input_ids", token), ("attention_mask", 1), ("token_type_ids", 0)):
        if key in y:
            v = y[key]
            y[key] = torch.cat([v[:, :1], torch.full((b, n), fill, dtype=v.dtype), v[:, 1:]], dim=1)
    if form.startswith("grid:") and ctx.has("mm_token_type_ids"):   # image tokens (1), for its 3-D positions
        y["mm_token_type_ids"] = (y["input_ids"] == token).long()
    return y


@torch.no_grad()
def runs_on_meta(ctx: Ctx, x: dict) -> bool:
    """Whether the model's structure takes `x` (a model without weights here, as streaming builds it: a forward
    on the meta device checks shapes and the paths the inputs open, not values)."""
    if not isinstance(ctx.module, nn.Module) or not any(p.is_meta for p in ctx.module.parameters()):
        return False
    try:   # a fresh skeleton: streaming's model holds some real tensors (norms, biases) beside meta ones
        with torch.device("meta"):
            skeleton = type(ctx.module)(ctx.config)
    except Exception:
        return False
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else tuple(t.to("meta") for t in v)
                if isinstance(v, tuple) else v) for k, v in x.items()}
    return not run(skeleton, meta)


@torch.no_grad()
def run(model: nn.Module, x: dict) -> str:
    """"" if `model(**x)` runs, else the first line of its error; the model's mode is kept."""
    training = model.training
    try:
        model.eval()
        model(**x)
        return ""
    except Exception as e:
        return (str(e).strip().splitlines() or [type(e).__name__])[0]
    finally:
        model.train(training)
