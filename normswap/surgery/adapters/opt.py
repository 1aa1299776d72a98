"""OPT: sequential blocks; pre-LN only when do_layer_norm_before (OPT-350m is post-LN and refused).

With word_embed_proj_dim != hidden_size, project_in writes the stream (the tied token embedding is
then untouched) and project_out reads the final norm.
"""
from normswap.surgery.adapters import Arch, NotExact, post_ln, register


@register("opt")
def opt(config) -> Arch:
    if not config.do_layer_norm_before:
        raise post_ln("opt with do_layer_norm_before=False")
    if getattr(config, "_remove_final_layer_norm", False):
        raise NotExact("OPT without a final layer norm is not covered by the exact adapter")
    projected = config.word_embed_proj_dim != config.hidden_size
    return Arch(embeddings=["decoder.project_in" if projected else "decoder.embed_tokens",
                            "decoder.embed_positions"],
                blocks="decoder.layers",
                norms={"self_attn_layer_norm": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                       "final_layer_norm": ["fc1"]},
                writers=["self_attn.out_proj", "fc2"], final_norm="decoder.final_layer_norm",
                final_consumers=["decoder.project_out"] if projected else [])
