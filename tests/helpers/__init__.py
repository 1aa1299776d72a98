"""Models, data and helpers shared by the tests (importable as `helpers.*`: pytest puts tests/ on the path)."""

from transformers.modeling_outputs import CausalLMOutputWithPast as _Out

# What a causal LM's output calls its cache: `past_key_values` up to transformers 5.23, `cache` from 5.24.
CACHE = "cache" if "cache" in _Out.__dataclass_fields__ else "past_key_values"
