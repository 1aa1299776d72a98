"""Tiny models whose exact plan has an input fix or another structural change, beyond `exact_models` and the
traced families of tests/surgery/test_trace.py: what a converted folder must rebuild in plain transformers."""
from __future__ import annotations

import transformers as tf

from helpers.exact_models import D, V, wav2vec2_config

LAYERS = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
SEQ2SEQ = dict(vocab_size=V, d_model=D, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
               pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
# wav2vec2_config's sizes, stable layer norm (pre-LN), for the other speech encoders of its kind
STABLE = {k: v for k, v in wav2vec2_config(do_stable_layer_norm=True, feat_extract_norm="layer").to_diff_dict().items()
          if k not in ("model_type", "transformers_version", "architectures")}
VISION = dict(hidden_size=D, patch_size=8, **LAYERS)

MAKERS = {
    "xglm": lambda: tf.XGLMForCausalLM(tf.XGLMConfig(vocab_size=V, d_model=D, num_layers=2, attention_heads=4,
                                                     ffn_dim=64, max_position_embeddings=64)),
    "ctrl": lambda: tf.CTRLLMHeadModel(tf.CTRLConfig(vocab_size=V, n_embd=D, n_layer=2, n_head=4, dff=64,
                                                     n_positions=64)),
    "esm": lambda: tf.EsmModel(tf.EsmConfig(vocab_size=33, hidden_size=D, pad_token_id=1, mask_token_id=32,
                                            emb_layer_norm_before=False, position_embedding_type="rotary",
                                            token_dropout=True, max_position_embeddings=64, **LAYERS)),
    "m2m100": lambda: tf.M2M100ForConditionalGeneration(tf.M2M100Config(**SEQ2SEQ)),
    "seamless_m4t-text": lambda: tf.SeamlessM4TForTextToText(tf.SeamlessM4TConfig(
        hidden_size=D, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        encoder_attention_heads=4, decoder_attention_heads=4, vocab_size=V, speech_encoder_layers=1,
        t2u_encoder_layers=1, t2u_decoder_layers=1, pad_token_id=0, bos_token_id=2, eos_token_id=3,
        decoder_start_token_id=3, max_position_embeddings=64)),
    "hubert-stable": lambda: tf.HubertModel(tf.HubertConfig(**STABLE)),
    "unispeech_sat-stable": lambda: tf.UniSpeechSatModel(tf.UniSpeechSatConfig(**STABLE)),
    # transformers 5 renames its attention's q_bias / v_bias to query.bias / value.bias when loading
    "videomae-pretrain": lambda: tf.VideoMAEForPreTraining(tf.VideoMAEConfig(
        image_size=32, num_frames=4, tubelet_size=2, qkv_bias=True, decoder_hidden_size=D, decoder_num_hidden_layers=1,
        decoder_num_attention_heads=4, decoder_intermediate_size=64, **VISION)),
    # its feature projection's norm reads the input features: the fix is on the model itself (the root), whose
    # class the save must still find to be transformers' own
    "wav2vec2-bert": lambda: tf.Wav2Vec2BertModel(tf.Wav2Vec2BertConfig(
        hidden_size=D, feature_projection_input_dim=32, conv_depthwise_kernel_size=3, position_embeddings_type=None,
        add_adapter=False, **LAYERS)),
    "yolos": lambda: tf.YolosForObjectDetection(tf.YolosConfig(image_size=[32, 32], num_detection_tokens=4,
                                                               use_mid_position_embeddings=False, **VISION)),
}
