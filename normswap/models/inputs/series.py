"""Non-token sequences: time series (PatchTST, PatchTSMixer, Time Series Transformer, Informer, Autoformer,
TimesFM: past and future values, time features, observed masks, static features, padding, frequency) and
RL trajectories (Decision Transformer: states, actions, rewards, returns to go, timesteps)."""
from __future__ import annotations

import torch

from normswap.models.inputs.context import Ctx
from normswap.models.inputs.text import padded_mask

TRAJECTORY = 8   # steps of a sample trajectory


def series(ctx: Ctx, x: dict, b: int) -> None:
    """Every time-series input the forward takes, sized from the config (context and prediction lengths,
    lags, channels, time and static features)."""
    context = ctx.integer("context_length")
    if context is None:
        raise ctx.refuse("`past_values` without a `context_length` in the config")
    lags = ctx.value("lags_sequence")
    past = context + (max(lags) if lags else 0)
    channels = ctx.integer("num_input_channels", "input_size", default=1)
    # Time Series Transformer & co and TimesFM take (b, length) for one variable; the patch models always a
    # channel axis
    flat = ctx.has("past_time_features") or ctx.has("past_values_padding")
    shape = (b, past) if channels == 1 and flat else (b, past, channels)
    x["past_values"] = ctx.randn(*shape)
    if ctx.has("past_values_padding"):   # TimesFM: every step real, and each series' frequency class
        x["past_values_padding"] = torch.zeros(shape, dtype=torch.long)
    if ctx.has("freq"):
        x["freq"] = ctx.randint(ctx.integer("freq_size", default=1), (b, 1))
    time = ctx.integer("num_time_features", default=0)
    horizon = ctx.integer("prediction_length", default=1)
    for name, value in (("past_time_features", lambda: ctx.randn(b, past, time)),
                        ("past_observed_mask", lambda: torch.ones(shape, dtype=ctx.dtype)),
                        ("observed_mask", lambda: torch.ones(shape, dtype=ctx.dtype)),
                        ("future_values", lambda: ctx.randn(b, horizon, *shape[2:])),
                        ("future_time_features", lambda: ctx.randn(b, horizon, time))):
        if ctx.has(name) and (name != "future_values" or ctx.has("future_time_features")):
            x[name] = value()
    cats = ctx.integer("num_static_categorical_features", default=0)
    if ctx.has("static_categorical_features") and cats:
        sizes = (ctx.value("cardinality") or [1] * cats)[:cats]
        x["static_categorical_features"] = torch.stack([ctx.randint(max(1, n), (b,)) for n in sizes], dim=1)
    reals = ctx.integer("num_static_real_features", default=0)
    if ctx.has("static_real_features") and reals:
        x["static_real_features"] = ctx.randn(b, reals)


def trajectory(ctx: Ctx, x: dict, b: int, padded: bool) -> None:
    """A Decision Transformer batch: states, actions, rewards, returns to go, timesteps, attention mask."""
    state, act = ctx.integer("state_dim"), ctx.integer("act_dim")
    if state is None or act is None:
        raise ctx.refuse("`states` need `state_dim` and `act_dim` in the config")
    t = min(TRAJECTORY, ctx.integer("max_ep_len", default=TRAJECTORY))
    x.update(states=ctx.randn(b, t, state), actions=ctx.randn(b, t, act), rewards=ctx.randn(b, t, 1),
             returns_to_go=ctx.randn(b, t, 1), timesteps=ctx.randint(ctx.integer("max_ep_len", default=t), (b, t)))
    if ctx.has("attention_mask"):
        x["attention_mask"] = padded_mask(b, t, padded)
