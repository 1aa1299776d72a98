"""Falcon: parallel attention with one norm (7B) or two (ln_attn/ln_mlp, 40B/180B), or sequential;
linears usually bias-less, so folding a norm bias creates one."""
from normswap.surgery.adapters import Arch, register

QKV, FC_IN = "self_attention.query_key_value", "mlp.dense_h_to_4h"


@register("falcon")
def falcon(config) -> Arch:
    # Norms absent from a given layout are simply not found in the model.
    return Arch(embeddings=["word_embeddings"], blocks="h",
                norms={"input_layernorm": [QKV, FC_IN] if config.parallel_attn else [QKV],
                       "post_attention_layernorm": [FC_IN], "ln_attn": [QKV], "ln_mlp": [FC_IN]},
                writers=["self_attention.dense", "mlp.dense_4h_to_h"], final_norm="ln_f")
