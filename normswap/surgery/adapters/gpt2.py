"""GPT-2: sequential pre-LN blocks, Conv1D projections, learned positions, tied head."""
from normswap.surgery.adapters import Arch, NotExact, register


@register("gpt2")
def gpt2(config) -> Arch:
    if getattr(config, "add_cross_attention", False):
        raise NotExact("GPT-2 with cross-attention blocks is not covered by the exact adapter")
    return Arch(embeddings=["wte", "wpe"], blocks="h",
                norms={"ln_1": ["attn.c_attn"], "ln_2": ["mlp.c_fc"]},
                writers=["attn.c_proj", "mlp.c_proj"], final_norm="ln_f")
