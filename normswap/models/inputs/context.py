"""What sample inputs are built from: the forward signature, the config with all its nested configs, the
model's own modules (sizes its embeddings expect), a seeded generator, the device and dtype."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from normswap.errors import NormswapError

# Where each kind of size is looked up first, after the top-level config; every other nested config follows.
TEXT = ("text_config", "text_encoder", "encoder", "language_config", "llm_config", "decoder")
VISION = ("vision_config", "backbone_config", "encoder", "vision_encoder_config", "image_config", "visual")
AUDIO = ("audio_config", "audio_encoder", "speech_config", "encoder")
DECODER = ("decoder", "text_config", "language_config")


def nested_configs(config) -> list:
    """`config` and every config nested in it (text_config, vision_config, backbone_config, encoder...),
    breadth first, each once."""
    out, queue, seen = [], [config], set()
    while queue:
        c = queue.pop(0)
        if c is None or id(c) in seen:
            continue
        seen.add(id(c))
        out.append(c)
        queue += [v for v in vars(c).values() if hasattr(v, "to_dict") and hasattr(v, "model_type")]
    return out


@dataclass
class Ctx:
    """One sample_inputs call: where to look things up and how to draw random values."""
    model: object
    batch: int
    seq: int
    seed: int
    config: object = field(init=False)
    params: dict = field(init=False)
    module: nn.Module | None = field(init=False)
    device: torch.device = field(init=False)
    dtype: torch.dtype = field(init=False)
    g: torch.Generator = field(init=False)

    def __post_init__(self):
        self.config = self.model.config
        self.params = dict(inspect.signature(self.model.forward).parameters)
        # a stand-in for a model on meta (a lazy conversion) carries the real module's bound forward
        self.module = self.model if isinstance(self.model, nn.Module) else \
            getattr(self.model.forward, "__self__", None)
        ref = next(iter(self.model.parameters()), None)
        self.device = ref.device if ref is not None else torch.device("cpu")
        self.dtype = ref.dtype if ref is not None and ref.is_floating_point() else torch.float32
        self.g = torch.Generator().manual_seed(self.seed)

    @property
    def runnable(self) -> bool:
        """True when the model has real weights here, so a trial forward can adapt a guess."""
        return isinstance(self.model, nn.Module) and self.device.type != "meta"

    def value(self, *keys: str, prefer: tuple[str, ...] = (), default=None):
        """The first of `keys` set (not None) on the config, then on the nested configs named in `prefer`,
        then on any other nested config."""
        first = [self.config, *(getattr(self.config, k, None) for k in prefer)]
        configs = [c for c in first if c is not None and hasattr(c, "to_dict")]
        configs += [c for c in nested_configs(self.config) if all(c is not f for f in configs)]
        for key in keys:
            for c in configs:
                v = getattr(c, key, None)
                if v is not None:
                    return v
        return default

    def integer(self, *keys: str, prefer: tuple[str, ...] = (), default=None, minimum: int = 1):
        """Like `value`, for integers >= minimum only (XLNet's -1 means no limit; bools are not sizes;
        token ids pass minimum=0)."""
        for key in keys:
            v = self.value(key, prefer=prefer)
            if isinstance(v, int) and not isinstance(v, bool) and v >= minimum:
                return v
        return default

    def module_attr(self, name: str):
        """The first integer-or-tuple attribute `name` on the model's modules (e.g. a patch embedding's
        num_patches or image_size): the size its own layers were built for."""
        if self.module is None:
            return None
        for m in self.module.modules():
            v = getattr(m, name, None)
            if isinstance(v, int) and not isinstance(v, bool) or \
                    isinstance(v, (tuple, list)) and v and all(isinstance(i, int) for i in v):
                return v
        return None

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g).to(self.dtype)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=self.g).to(self.dtype)

    def randint(self, high: int, shape, low: int = 0) -> torch.Tensor:
        return torch.randint(low, high, tuple(shape), generator=self.g)

    def has(self, name: str) -> bool:
        return name in self.params

    def passes_on(self, name: str) -> bool:
        """The forward takes `name`, or takes **kwargs and a direct child's forward takes `name` (an image
        classifier handing `bool_masked_pos` on to its backbone)."""
        if self.has(name):
            return True
        if self.module is None or not any(p.kind is p.VAR_KEYWORD for p in self.params.values()):
            return False
        return any(name in inspect.signature(m.forward).parameters for m in self.module.children()
                   if type(m).forward is not nn.Module.forward)

    def required(self) -> list[str]:
        """The forward's parameters without a default (other than self, *args, **kwargs)."""
        return [n for n, p in self.params.items() if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n != "self"]

    def refuse(self, what: str) -> NormswapError:
        return NormswapError(f"cannot build sample inputs for {type(self.module or self.model).__name__}: {what}")


def pair(size) -> tuple[int, int] | None:
    """(height, width) from an int or a sequence (its last two entries), else None."""
    if isinstance(size, int) and not isinstance(size, bool):
        return size, size
    if isinstance(size, (tuple, list)) and size and all(isinstance(v, int) for v in size):
        return (size[-2], size[-1]) if len(size) > 1 else (size[0], size[0])
    return None
