"""GPT-Neo: GPT-2 layout with nn.Linear projections and local/global attention."""
from normswap.surgery.adapters import Arch, register


@register("gpt_neo")
def gpt_neo(config) -> Arch:
    return Arch(embeddings=["wte", "wpe"], blocks="h",
                norms={"ln_1": ["attn.attention.q_proj", "attn.attention.k_proj", "attn.attention.v_proj"],
                       "ln_2": ["mlp.c_fc"]},
                writers=["attn.attention.out_proj", "mlp.c_proj"], final_norm="ln_f")
