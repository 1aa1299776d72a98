"""Phi (1, 1.5, 2): one norm per block read by attention and MLP in parallel; biased head."""
from normswap.surgery.adapters import Arch, NotExact, register


@register("phi")
def phi(config) -> Arch:
    if getattr(config, "qk_layernorm", False):
        raise NotExact("Phi with qk_layernorm: the query/key norm biases enter attention scores and cannot "
                       "be folded")
    return Arch(embeddings=["embed_tokens"], blocks="layers",
                norms={"input_layernorm": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.fc1"]},
                writers=["self_attn.dense", "mlp.fc2"], final_norm="final_layernorm")
