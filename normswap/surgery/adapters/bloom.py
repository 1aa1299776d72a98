"""BLOOM: ALiBi, sequential blocks, and word_embeddings_layernorm between the embedding and the stream."""
from normswap.surgery.adapters import Arch, post_ln, register


@register("bloom")
def bloom(config) -> Arch:
    if config.apply_residual_connection_post_layernorm:
        raise post_ln("bloom with apply_residual_connection_post_layernorm=True")
    return Arch(embeddings=["word_embeddings"], embed_norm="word_embeddings_layernorm", blocks="h",
                norms={"input_layernorm": ["self_attention.query_key_value"],
                       "post_attention_layernorm": ["mlp.dense_h_to_4h"]},
                writers=["self_attention.dense", "mlp.dense_4h_to_h"], final_norm="ln_f")
