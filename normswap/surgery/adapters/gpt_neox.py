"""GPT-NeoX / Pythia: two norms per block, parallel (use_parallel_residual) or sequential residual.

Both layouts read the norms the same way, so one description covers both.
"""
from normswap.surgery.adapters import Arch, register


@register("gpt_neox")
def gpt_neox(config) -> Arch:
    return Arch(embeddings=["embed_in"], blocks="layers",
                norms={"input_layernorm": ["attention.query_key_value"],
                       "post_attention_layernorm": ["mlp.dense_h_to_4h"]},
                writers=["attention.dense", "mlp.dense_4h_to_h"], final_norm="final_layer_norm")
