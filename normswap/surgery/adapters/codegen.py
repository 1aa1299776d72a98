"""CodeGen: GPT-J layout with a fused qkv projection."""
from normswap.surgery.adapters import Arch, register


@register("codegen")
def codegen(config) -> Arch:
    return Arch(embeddings=["wte"], blocks="h", norms={"ln_1": ["attn.qkv_proj", "mlp.fc_in"]},
                writers=["attn.out_proj", "mlp.fc_out"], final_norm="ln_f")
