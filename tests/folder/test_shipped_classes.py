"""The transformers side of the shipped modeling file (`normswap/folder/shipped.py`), as plain transformers runs it."""
from __future__ import annotations

import pytest
import transformers as tf

import normswap

from helpers.tiny import tiny_model


@pytest.mark.parametrize("family,targets", [("gpt2", {"c_attn"}), ("opt", {"q_proj", "v_proj"})])
def test_peft_picks_the_originals_default_targets(tmp_path, family, targets):
    """LoraConfig without target_modules on a plain-loaded folder (model_type normswap_<type>) targets what it
    targets on the original; peft raised "Please specify `target_modules`" before (issue 33.4)."""
    peft = pytest.importorskip("peft")
    model = tiny_model(family)
    normswap.convert(model, method="naive", to="rmsnorm")
    normswap.save_pretrained(model, tmp_path / "m")
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "m", trust_remote_code=True)
    assert loaded.config.model_type == f"normswap_{family}"
    adapted = peft.get_peft_model(loaded, peft.LoraConfig(task_type="CAUSAL_LM"))
    assert set(adapted.peft_config["default"].target_modules) == targets
