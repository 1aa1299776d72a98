"""GPT-J: one norm per block read by attention and MLP in parallel; rotary; biased head."""
from normswap.surgery.adapters import Arch, register


@register("gptj")
def gptj(config) -> Arch:
    return Arch(embeddings=["wte"], blocks="h",
                norms={"ln_1": ["attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in"]},
                writers=["attn.out_proj", "mlp.fc_out"], final_norm="ln_f")
