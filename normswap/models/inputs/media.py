"""Media spliced into a decoder's text: images, videos and audio at their tokens, as many as one item fills
(guessed from the config, then taken from the model's own error by a trial forward), in the form the model
reads (flattened patches, an images axis, tiles, patch lists with their grids, features in either axis order);
images placed by a position mask instead (Kosmos-2)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from normswap.models.inputs import audio, text, vision
from normswap.models.inputs.context import Ctx
from normswap.models.inputs.runs import run

# how many tiles of one image the model expected (LLaVA-NeXT splits its pixel values per image)
TILES = re.compile(r"split_sizes to sum exactly to \d+ .*got split_sizes=\[(\d+)")
# what the model reports when the image (video, audio) tokens in the text do not match its features
MISMATCH = re.compile(r"(?:(?:image|video|audio) tokens|features and tokens) do not match\W+tokens\W+(\d+)\W+"
                      r"features\W+(\d+)", re.I)
# a decoder's inputs that it splices into its text at their tokens: input -> (what they are, their token)
MEDIA = {"pixel_values": ("image", vision.image_token), "pixel_values_videos": ("video", vision.video_token),
         "input_features": ("audio", audio.audio_token)}


@dataclass(frozen=True)
class Form:
    """How a media input is laid out for the model (`spliced`): as built; "transposed" (audio features'
    other axis order); flattened "patches" (Fuyu); "per image" (an images axis: Idefics); "tiles" (that axis,
    its tiles marked: Granite-Docling); "sized" (each image's size given); "grid" (one list of patches in the
    tower's patch shape number `n`, with each image's grid: Qwen-VL); "split" (`n` tiles per image, with their
    sizes: LLaVA-NeXT)."""

    kind: Literal["as built", "transposed", "patches", "per image", "tiles", "sized", "grid", "split"]
    n: int = 0


@dataclass(frozen=True)
class Complaint:
    """What a model's error says it wanted: the image (video, audio) `features` it counted where they did not
    match the tokens, the `tiles` per image it expected; None where the error does not say."""

    features: int | None = None
    tiles: int | None = None


def read_complaint(error: str) -> Complaint:
    """What the model's error (its first line) says it wanted. Transformers raises plain ValueErrors and
    RuntimeErrors and says these counts only in their text: this is the one place that reads it."""
    mismatch, tiles = MISMATCH.search(error), TILES.search(error)
    return Complaint(int(mismatch.group(2)) if mismatch else None, int(tiles.group(1)) if tiles else None)


def placed_images(ctx: Ctx, x: dict) -> dict:
    """x with room for one image's features after each row's first token, marked in the mask the model places
    them by (Kosmos-2's `image_embeds_position_mask`) rather than at image tokens."""
    n = vision.image_tokens_per_image(ctx) or 1
    y = spliced(ctx, x, int(text.ids(ctx, (1,))[0]), n, Form("as built"))
    y["image_embeds_position_mask"] = torch.zeros_like(y["input_ids"])
    y["image_embeds_position_mask"][:, 1:1 + n] = 1
    return y


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
        drop = {key, *(audio.FRAME_MASKS if key == "input_features" else ())}   # and the masks over its frames
        return [{k: v for k, v in x.items() if k not in drop} for x in batches]
    form, n = found
    return [spliced(ctx, x, token, n, form) if i in todo else x for i, x in enumerate(batches)]


def trial(ctx: Ctx, x: dict, token: int, n: int, key: str) -> tuple[tuple[Form, int] | None, str]:
    """((form of the `key` input, tokens per item), "") that the model runs with, or (None, its last error)."""
    error = ""
    hidden = ctx.integer("hidden_size", "d_model", prefer=("text_config",), default=1)
    if key == "input_features":   # a 2-D convolution over the spectrogram reads either axis order
        forms = [Form("as built"), Form("transposed")]
    elif key != "pixel_values":   # videos as built
        forms = [Form("as built")]
    elif ctx.has("image_grid_thw"):   # one list of patches in each shape a tower reads (vision.patch_shapes)
        forms = [Form("grid", 0), Form("grid", 1), Form("grid", 2)]
    else:
        forms = [Form("as built"), Form("patches"), Form("per image")] + [Form("tiles")] * \
            ctx.has("pixel_attention_mask") + [Form("sized")] * ctx.has("image_sizes")
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
            said = read_complaint(error)
            if said.features is not None:   # features reported per token, or (some models) per value
                b, f = len(y[key]), said.features
                counts += [c // b for c in (f, f // hidden) if c % b == 0 and c >= b and c // b not in tried]
            if key == "pixel_values" and said.tiles is not None and Form("split", said.tiles) not in forms:
                # the tiles per image it wants (LLaVA-NeXT); an audio model's split error is no such thing
                forms.append(Form("split", said.tiles))
    return None, error


def spliced(ctx: Ctx, x: dict, token: int, n: int, form: Form) -> dict | None:
    """x with n image (video, audio) tokens after the first token of every row (masks and token types grow
    with them), its images in the given form."""
    y = dict(x)
    b = y["input_ids"].shape[0]
    if form.kind == "grid":   # Qwen-VL: one list of patches, each image's grid, the tokens it merges into
        patches, y["image_grid_thw"] = vision.grid_patches(ctx, len(x["pixel_values"]), wide=False)
        shapes = vision.patch_shapes(ctx, patches)
        if form.n >= len(shapes):
            return None
        y["pixel_values"] = shapes[form.n]
        n = int(y["image_grid_thw"][0].prod()) // vision.merge(ctx) ** 2
        if ctx.has("image_merge_sizes"):   # Video-LLaMA 3: each image's merge
            y["image_merge_sizes"] = vision.merges(ctx, len(y["image_grid_thw"]))
    elif form.kind == "patches":
        y["pixel_values"] = vision.flat_patches(ctx, len(x["pixel_values"]))
        if y["pixel_values"] is None:
            return None
    elif form.kind == "transposed":   # audio features (batch, mels, frames) <-> (batch, frames, mels); as many frames
        y["input_features"] = x["input_features"].transpose(1, 2).contiguous()
    elif form.kind in ("per image", "tiles"):   # (batch, images, channels, h, w): Idefics
        y["pixel_values"] = x["pixel_values"][:, None]
        if form.kind == "tiles":   # Granite-Docling: each row's real tiles marked
            y["pixel_attention_mask"] = torch.ones(len(x["pixel_values"]), 1, dtype=torch.bool)
    elif form.kind == "split":   # (batch, tiles, channels, h, w): LLaVA-NeXT's tiles of each image
        y["pixel_values"] = x["pixel_values"][:, None].expand(-1, form.n, -1, -1, -1).contiguous()
    if form.kind in ("sized", "split"):   # each image's (height, width): LLaVA-NeXT tiles by them
        y["image_sizes"] = torch.tensor([list(vision.image_size(ctx))] * len(x["pixel_values"]))
    for key, fill in (("input_ids", token), ("attention_mask", 1), ("token_type_ids", 0)):
        if key in y:
            v = y[key]
            y[key] = torch.cat([v[:, :1], torch.full((b, n), fill, dtype=v.dtype), v[:, 1:]], dim=1)
    if ctx.has("mm_token_type_ids"):   # image (1) and video (2) tokens marked: Qwen-VL's 3-D positions, MiniCPM-V
        types = torch.zeros_like(y["input_ids"])
        for kind, media_token in ((1, vision.image_token(ctx)), (2, vision.video_token(ctx))):
            if media_token is not None:
                types[y["input_ids"] == media_token] = kind
        y["mm_token_type_ids"] = types
    return y
