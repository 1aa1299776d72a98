"""LoRA for `heal` (train="lora"), through peft: low-rank adapters on the model's linear layers, trained with
the norm gains, then merged into the weights, so the healed model (and the folder saved from it) is the plain
architecture again, with no peft module or parameter name left.

The adapters are injected into the model in place (peft's LoraModel, not a PeftModel wrapper): the model keeps
its class and forward, so the loop, DDP and FSDP see the same model they see without LoRA.
"""
from __future__ import annotations

import warnings

from torch import nn

from normswap.errors import NormswapError
from normswap.healing.options import LoraOptions
from normswap.folder.shipped import original_class


def _conv1d():
    from transformers.pytorch_utils import Conv1D
    return Conv1D


def _tied_head(model: nn.Module) -> nn.Module | None:
    """The output head, if its weight is the input embeddings' (an adapter on it would change both)."""
    try:
        head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if head is not None and emb is not None and getattr(head, "weight", None) is getattr(emb, "weight", 0):
        return head
    return None


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> module of every nn.Linear and transformers Conv1D (GPT-2's (in, out) linear layers)."""
    kinds = (nn.Linear, _conv1d())
    return {name: m for name, m in model.named_modules() if name and isinstance(m, kinds)}


def targets(model: nn.Module, requested: tuple[str, ...] | None) -> list[str]:
    """Qualified names of the layers to adapt. None: every linear layer but the output head. A requested name
    is a module's last name ("c_attn", every layer so named) or its full dotted name."""
    layers = linear_layers(model)
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        head = None
    tied = _tied_head(model)
    if requested is None:
        chosen = [n for n, m in layers.items() if m is not head]
        if not chosen:
            raise NormswapError(f"{original_class(model).__name__} has no linear layer to put LoRA adapters on: use "
                                f"`train='norms'` or `train='all'`")
        return chosen
    short = sorted({n.rsplit(".", 1)[-1] for n in layers})
    chosen = []
    for want in requested:
        found = [n for n in layers if n == want or n.endswith("." + want)]
        if not found:
            other = "a module but not a linear layer" if any(
                n == want or n.endswith("." + want) for n, _ in model.named_modules()) else "no module"
            raise NormswapError(f"unknown LoRA target '{want}' (`lora.targets`): {other} of that name; the "
                                f"model's linear layers are {', '.join(short)}")
        if any(layers[n] is tied for n in found):
            raise NormswapError(f"LoRA target '{want}' (`lora.targets`) is the output head, whose weight is the "
                                f"input embeddings': an adapter merged into it would change both")
        chosen += [n for n in found if n not in chosen]
    return chosen


class Adapters:
    """LoRA adapters injected into a model in place; `merge()` folds them into the weights and removes them."""

    def __init__(self, model: nn.Module, options: LoraOptions):
        try:
            from peft import LoraConfig
            from peft.tuners.lora import LoraModel
        except ImportError:
            raise NormswapError("`train='lora'` needs peft: pip install 'normswap[heal]' (or pip install peft)") \
                from None
        names = targets(model, options.targets)
        conv1d = _conv1d()
        layers = linear_layers(model)
        self.targets = sorted({n.rsplit(".", 1)[-1] for n in names})   # short names, for the report
        # Conv1D stores its weight (in, out): peft's fan_in_fan_out; it fixes the flag per layer when a model
        # mixes both kinds, with a warning we silence because it is expected.
        config = LoraConfig(r=options.rank, lora_alpha=options.scale * options.rank, lora_dropout=0.0,
                            target_modules=names, bias="none",
                            fan_in_fan_out=all(isinstance(layers[n], conv1d) for n in names))
        self.model, self.had_config = model, hasattr(model, "peft_config")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
            self.tuner = LoraModel(model, config, "default")
        self.params = [p for n, p in model.named_parameters() if ".lora_" in n]
        self.merged = False

    def merge(self) -> None:
        """Fold the adapters into the weights (in the parameters' dtype) and put the original layers back."""
        if not self.merged:
            self.tuner.merge_and_unload()
            if not self.had_config and hasattr(self.model, "peft_config"):  # peft < 0.14 leaves it behind
                del self.model.peft_config
            self.merged = True
