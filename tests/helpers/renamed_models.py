"""transformers 5's renamed families that normswap converts exactly: the cases of tests/models/test_renamed.py,
built tiny by benchmarks/architectures.py (the sweep's own `build`, so that a case is the model it measured)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from torch import nn

from helpers.exact_models import perturb

_spec = importlib.util.spec_from_file_location(
    "architectures", Path(__file__).resolve().parents[2] / "benchmarks" / "architectures.py")
architectures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(architectures)

# The class built -> the keys of transformers' checkpoint renaming table (model types or class names) it covers.
# Chosen by `python benchmarks/renamed.py` on transformers 5.24.0 (torch 2.14.1 CPU), not by hand: every key of
# `conversion_mapping._build_checkpoint_conversion_mapping()` but "legacy" (the renaming every model gets), 260,
# built tiny (a class name: that class; a model type: its classes in the Auto tables, up to 4, in turn), 197
# built, 129 of them with a LayerNorm; converted with method="auto", saved and reloaded; kept where the
# conversion ends exact or exact+kept and loading the model applies the key's renaming (its class's or its
# model_type's entry, or a sub-model's, as transformers picks them): 73 keys, one class each. ESM, which does
# not build tiny from its config's defaults, is tests/models/test_shipped.py's (EsmModel; VideoMAE's pre-training
# head, YOLOS's detector and GPT-NeoX are there too).
CASES = {
    "ASTModel": ("ASTModel",),
    "AXK2ForCausalLM": ("axk2",),
    "AriaForConditionalGeneration": ("aria",),
    "AriaModel": ("AriaModel",),
    "AudioFlamingo3ForConditionalGeneration": ("audioflamingo3",),
    "AudioFlamingo3Model": ("AudioFlamingo3Model",),
    "AyaVisionForConditionalGeneration": ("aya_vision",),
    "AyaVisionModel": ("AyaVisionModel",),
    "CLIPSegTextModel": ("CLIPSegTextModel",),
    "CLIPTextModel": ("CLIPTextModel",),
    "CohereAsrModel": ("cohere_asr",),
    "Cosmos3EdgeModel": ("cosmos3_edge",),
    "DINOv3ViTModel": ("dinov3_vit",),
    "DeepseekV32ForCausalLM": ("deepseek_v32",),
    "DeiTModel": ("DeiTModel",),
    "Dinov2Backbone": ("Dinov2Backbone",),
    "Dinov2Model": ("Dinov2Model",),
    "Dinov2WithRegistersBackbone": ("Dinov2WithRegistersBackbone",),
    "Dinov2WithRegistersModel": ("Dinov2WithRegistersModel",),
    "FuyuForCausalLM": ("fuyu",),
    "FuyuModel": ("FuyuModel",),
    "GPTNeoXForCausalLM": ("GPTNeoXForCausalLM",),
    "Gemma3ForConditionalGeneration": ("gemma3",),
    "Gemma3Model": ("Gemma3Model",),
    "Glm4vMoeModel": ("glm4v_moe",),
    "GlmAsrForConditionalGeneration": ("glmasr",),
    "GlmAsrModel": ("GlmAsrModel",),
    "GlmMoeDsaForCausalLM": ("glm_moe_dsa",),
    "HYV4ForCausalLM": ("hy_v4",),   # renamings not idempotent (`hc_` in both names): once, not twice
    "HYV4Model": ("hy_v4",),
    "HYV4VLModel": ("hy_v4_vl",),
    "HYV4VLTextModel": ("hy_v4_vl_text",),
    "IJepaModel": ("IJepaModel",),
    "InternVLForConditionalGeneration": ("internvl",),
    "InternVLModel": ("InternVLModel",),
    "Kimi_K25Model": ("kimi_k25",),
    "MetaClip2TextModel": ("MetaClip2TextModel",),
    "MistralLarge4Model": ("mistral_large4",),
    "MistralLarge4TextModel": ("mistral_large4_text",),
    "MusicFlamingoForConditionalGeneration": ("musicflamingo",),
    "MusicFlamingoModel": ("MusicFlamingoModel",),
    "PaddleOCRVLModel": ("paddleocr_vl",),
    "PaliGemmaForConditionalGeneration": ("paligemma",),
    "PaliGemmaModel": ("PaliGemmaModel",),
    "PhimoeForCausalLM": ("phimoe",),
    "PixioModel": ("pixio",),
    "QianfanOCRModel": ("qianfan_ocr",),
    "Qwen2AudioForConditionalGeneration": ("qwen2_audio",),
    "Qwen2AudioModel": ("Qwen2AudioModel",),
    "Qwen2VLForConditionalGeneration": ("Qwen2VLForConditionalGeneration",),
    "Qwen2VLModel": ("Qwen2VLModel",),
    "Qwen3OmniMoeThinkerForConditionalGeneration": ("Qwen3OmniMoeThinkerForConditionalGeneration",),
    "Qwen3OmniMoeThinkerModel": ("Qwen3OmniMoeThinkerModel",),
    "Siglip2TextModel": ("Siglip2TextModel",),
    "Siglip2VisionModel": ("Siglip2VisionModel",),
    "SiglipTextModel": ("SiglipTextModel",),
    "SiglipVisionModel": ("SiglipVisionModel",),
    "SwinBackbone": ("SwinBackbone",),
    "SwinForImageClassification": ("swin",),
    "Tipsv2Model": ("tipsv2",),
    "Tipsv2TextModel": ("Tipsv2TextModel",),
    "Tipsv2VisionBackbone": ("Tipsv2VisionBackbone",),
    "Tipsv2VisionModel": ("Tipsv2VisionModel",),
    "UltraVBertForMaskedLM": ("UltraVBertForMaskedLM",),
    "ViTMAEForPreTraining": ("ViTMAEForPreTraining",),
    "ViTMAEModel": ("ViTMAEModel",),
    "ViTMSNForImageClassification": ("ViTMSNForImageClassification",),
    "ViTMSNModel": ("ViTMSNModel",),
    "ViTModel": ("ViTModel",),
    "VideoMAEForVideoClassification": ("videomae",),
    "VivitModel": ("VivitModel",),
    "VoxtralForConditionalGeneration": ("voxtral",),
    "VoxtralModel": ("VoxtralModel",),
    "YolosModel": ("yolos",),
}


def build(name: str) -> nn.Module:
    """The class `name` (a key of CASES), tiny and perturbed; checked to be renamed by its keys here."""
    model, _ = architectures.build(name)
    missing = set(CASES[name]) - set(architectures.renamed_by(model))
    assert not missing, f"loading {name} does not apply the renaming of {sorted(missing)} in this transformers"
    return perturb(model).eval()
