"""Lazy conversion of checkpoint folders (`pipeline.lazy_convert`): bit-identical to the in-memory path, in
bounded memory."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.exact_models import FAMILIES, perturb
from helpers.folders import same_fingerprint, split_config
from click.testing import CliRunner

import normswap
from normswap.io import safetensors as shards
from normswap.pipeline import lazy_convert
from normswap.checkpoint.lazy import InMemoryOnly
from normswap.errors import NormswapError
from normswap.parity import compare
from normswap.surgery import exact
from normswap.surgery.steps import Centre

NS_INDEX = "model.safetensors.index.normswap.json"   # a converted folder's weights: the "normswap" variant


def _save_family(fam: str, path: Path, dtype=torch.float32, shard="20kB") -> None:
    config_cls, kw, model_cls = FAMILIES[fam]
    torch.manual_seed(0)
    perturb(model_cls(config_cls(vocab_size=101, **kw))).to(dtype).save_pretrained(path, max_shard_size=shard)


def _same_tensors(a: Path, b: Path) -> None:
    sa, sb = normswap.from_pretrained(a).state_dict(), normswap.from_pretrained(b).state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    # the same section (the fingerprint's digest within its tolerance; the weights checksum covers each folder's
    # own file layout, shards or one file)
    (ca, fa), (cb, fb) = split_config(a), split_config(b)
    assert ca == cb
    same_fingerprint(fa, fb)


@pytest.mark.parametrize("fam,dtype,method", [("gpt2", torch.float32, "exact"), ("opt-project", torch.float32, "auto"),
                                              ("bloom", torch.float16, "exact"),
                                              ("gpt_neox-parallel", torch.float32, "exact"),
                                              ("mbart", torch.float32, "exact"),
                                              ("gpt2", torch.bfloat16, "naive")])
def test_lazy_equals_in_memory_bit_for_bit(tmp_path, monkeypatch, fam, dtype, method):
    from normswap.surgery import algebra
    monkeypatch.setattr(algebra, "CHUNK", 100)  # large tensors are edited a slice at a time, in both paths
    _save_family(fam, tmp_path / "src", dtype)
    assert (tmp_path / "src" / shards.INDEX).exists()
    model, _ = normswap.load_model(str(tmp_path / "src"))
    original = normswap.load_model(str(tmp_path / "src"))[0]
    mem_report = normswap.convert(model, method=method)
    normswap.save_pretrained(model, tmp_path / "mem", source=tmp_path / "src")   # keeps SRC's files, as the lazy path
    report, parity = lazy_convert.convert_folder(tmp_path / "src", tmp_path / "out", method=method,
                                                 max_shard_size="20kB")
    assert len(set(json.loads((tmp_path / "out" / NS_INDEX).read_text())["weight_map"].values())) >= 3
    _same_tensors(tmp_path / "out", tmp_path / "mem")
    assert [dataclasses.asdict(r) for r in report.converted] == [dataclasses.asdict(r) for r in mem_report.converted]
    assert report.added_biases == mem_report.added_biases and report.method == mem_report.method
    # The lazy verification computes what comparing the two whole models in fp32 computes.
    expected = compare(original.float(), normswap.from_pretrained(tmp_path / "out").float())
    assert parity.max_abs == pytest.approx(expected.max_abs, rel=1e-9, abs=1e-12)
    if method != "naive":
        assert parity.max_rel <= exact.TOLERANCE[dtype] and report.verification["enforced"]
    else:
        assert parity.max_rel > 1e-2  # the naive swap changes the function: the check can see it


def test_broken_plan_fails_verification_and_writes_nothing(tmp_path, monkeypatch):
    _save_family("gpt2", tmp_path / "src")
    real = exact.plan

    def no_centring(model, sites, inputs=None, **kw):  # forget to centre the stream writers: no longer exact
        p = real(model, sites, inputs, **kw)
        return dataclasses.replace(p, steps=[s for s in p.steps if not isinstance(s, Centre)])

    monkeypatch.setattr(exact, "plan", no_centring)
    with pytest.raises(NormswapError, match="failed verification"):
        lazy_convert.convert_folder(tmp_path / "src", tmp_path / "out", method="exact")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_cli_converts_folders_lazily_and_keeps_errors_one_line(tmp_path):
    from normswap.cli import main
    _save_family("opt", tmp_path / "src")
    run = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), "--to", "rmsnorm", "--method", "exact",
                                    "-o", str(tmp_path / "out"), "--max-shard-size", "30kB", "--json"])
    assert run.exit_code == 0, run.output
    out = json.loads(run.output)
    assert out["report"]["verification"]["max_rel"] < 1e-4 and out["parity"]["kl"] < 1e-9
    assert (tmp_path / "out" / NS_INDEX).exists()
    model, _ = normswap.load_model(str(tmp_path / "src"))
    normswap.convert(model, method="exact")
    normswap.save_pretrained(model, tmp_path / "mem", source=tmp_path / "src")
    _same_tensors(tmp_path / "out", tmp_path / "mem")
    # A missing shard: one line, nothing written.
    sorted((tmp_path / "src").glob("model-*"))[-1].unlink()
    run = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), "--to", "rmsnorm", "-o", str(tmp_path / "o2")])
    assert run.exit_code == 1 and run.output.count("\n") == 1 and "is missing" in run.output
    assert not (tmp_path / "o2").exists()


CHILD = textwrap.dedent("""
    import resource, sys
    from normswap.pipeline import lazy_convert
    warm, src, out = sys.argv[1:]
    lazy_convert.convert_folder(warm, out + "-warm", method="exact")  # imports and allocator warm-up, not counted
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    lazy_convert.convert_folder(src, out, method="exact", max_shard_size="10MB")
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
""")


@pytest.mark.slow
def test_lazy_peak_memory_is_a_fraction_of_the_checkpoint(tmp_path):
    """Holding the model (as loading it does) needs its size; the lazy path stays under half of it."""
    import transformers
    _save_family("gpt2", tmp_path / "tiny")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=8, n_embd=384, n_head=6, vocab_size=1024, n_positions=64)
    perturb(transformers.GPT2LMHeadModel(config)).save_pretrained(tmp_path / "src", max_shard_size="10MB")
    size = shards.Reader(tmp_path / "src").total_size()  # 58 MB; largest tensor 2.4 MB
    run = subprocess.run([sys.executable, "-c", CHILD, *map(str, (tmp_path / "tiny", tmp_path / "src",
                                                                  tmp_path / "out"))],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    peak = int(run.stdout.split()[-1])
    assert len(list((tmp_path / "out").glob("model.normswap-*.safetensors"))) >= 5
    assert peak < size / 2, (peak, size)


@pytest.mark.slow
def test_cli_converts_a_speech_model_lazily_with_its_ctc_head(tmp_path):
    """wav2vec2 (stable layer norm): sample waveforms from the config, the CTC head loaded (AutoModelForCTC),
    and the lazily converted folder bit-identical to the in-memory conversion."""
    import transformers as tf
    from click.testing import CliRunner
    from normswap.cli import main
    from helpers.exact_models import wav2vec2_config
    torch.manual_seed(0)
    perturb(tf.Wav2Vec2ForCTC(wav2vec2_config(do_stable_layer_norm=True))).save_pretrained(tmp_path / "src")
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), "--to", "rmsnorm", "--method", "exact",
                                       "-o", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["report"]["verification"]["max_rel"] <= 1e-5 and out["parity"]["max_rel"] <= 1e-5
    model, _ = normswap.load_model(str(tmp_path / "src"))
    assert type(model).__name__ == "Wav2Vec2ForCTC"
    normswap.convert(model, method="exact")
    normswap.save_pretrained(model, tmp_path / "mem", source=tmp_path / "src")
    _same_tensors(tmp_path / "out", tmp_path / "mem")


def _audio(cls_cfg, **kw):
    import transformers as tf
    return getattr(tf, cls_cfg)(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                                num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, **kw)


@pytest.mark.parametrize("make,method", [
    # the plan's trace keeps a view of pos_bias_u/v (`module.pos_bias_u[None, :, None, :]`) alive
    (lambda tf: tf.Wav2Vec2ConformerForCTC(_audio("Wav2Vec2ConformerConfig", position_embeddings_type="relative")),
     "exact"),
    # ViT: the same with cls_token.expand(...) (main fell back to naive: a README "exact" family)
    (lambda tf: tf.ViTForImageClassification(tf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                           intermediate_size=64, image_size=16, patch_size=4)),
     "exact"),
    # WavLM's attention passes q/k/v_proj.weight to F.multi_head_attention_forward without calling them
    (lambda tf: tf.WavLMForCTC(_audio("WavLMConfig", do_stable_layer_norm=True, feat_extract_norm="layer",
                                      num_buckets=16, max_bucket_distance=20)), "naive"),
])
def test_lazy_weights_read_outside_their_module(tmp_path, make, method):
    """The lazy path converts what the in-memory path converts, bit for bit, also when a module's weights are read
    without its forward running, or a view of one outlives its forward."""
    import transformers as tf
    torch.manual_seed(0)
    perturb(make(tf)).save_pretrained(tmp_path / "src")
    model, _ = normswap.load_model(str(tmp_path / "src"))
    mem = normswap.convert(model, method=method)
    normswap.save_pretrained(model, tmp_path / "mem", source=tmp_path / "src")
    report, parity = lazy_convert.convert_folder(tmp_path / "src", tmp_path / "out", method=method)
    assert report.method == mem.method == method
    _same_tensors(tmp_path / "out", tmp_path / "mem")
    # the lazy verification computes what the whole models compute (WavLM's positions are built on
    # rel_attn_embed.weight.device: on meta, the embedding lookup returned uninitialised memory)
    original = normswap.load_model(str(tmp_path / "src"))[0]
    expected = compare(original.float(), normswap.from_pretrained(tmp_path / "out").float())
    assert parity.max_abs == pytest.approx(expected.max_abs, rel=1e-6, abs=1e-9)
    if method == "exact":
        assert parity.max_rel <= 1e-5


def test_tied_tensors_stored_with_different_values_are_not_converted_lazily(tmp_path):
    """config ties lm_head to wte, but the file holds both, different: transformers unties them (the head is
    the stored lm_head). The lazy path built the tied model, used wte as the head, and its verification (against
    the same tied model) passed: the written model's logits were not the original's."""
    from safetensors.torch import load_file, save_file
    from normswap.cli import main
    _save_family("gpt2", tmp_path / "src", shard="1GB")
    state = load_file(tmp_path / "src" / shards.WEIGHTS)
    state["lm_head.weight"] = state["transformer.wte.weight"] * 2
    save_file(state, tmp_path / "src" / shards.WEIGHTS, metadata={"format": "pt"})
    original, _ = normswap.load_model(str(tmp_path / "src"))
    assert original.lm_head.weight is not original.transformer.wte.weight   # what transformers does
    with pytest.raises(InMemoryOnly, match="lm_head.weight with different values"):
        lazy_convert.convert_folder(tmp_path / "src", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    run = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), "--to", "rmsnorm", "-o", str(tmp_path / "out")])
    assert run.exit_code == 0 and "converting in memory" in run.stderr, run.output
    assert compare(original, normswap.from_pretrained(tmp_path / "out")).max_rel < 1e-4


@pytest.mark.slow
def test_a_folder_transformers_transforms_converts_in_memory(tmp_path):
    """PhiMoE (LayerNorm, experts stored one by one and merged by transformers when loading) converts only in
    memory; the CLI said "load the model in memory instead" and exited 1, with no way to do that from the CLI."""
    import transformers as tf
    from normswap.cli import main
    torch.manual_seed(0)
    perturb(tf.PhimoeForCausalLM(tf.PhimoeConfig(vocab_size=101, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=2,
                                                 max_position_embeddings=64))).save_pretrained(tmp_path / "src")
    with pytest.raises(InMemoryOnly, match="transformers transforms it"):
        lazy_convert.convert_folder(tmp_path / "src", tmp_path / "out")
    run = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), "--to", "rmsnorm", "-o", str(tmp_path / "out")])
    assert run.exit_code == 0 and "converting in memory" in run.stderr, run.output
    model, _ = normswap.load_model(str(tmp_path / "src"))
    normswap.convert(model)   # what the in-memory path does (naive here: the router reads the stream)
    normswap.save_pretrained(model, tmp_path / "mem", source=tmp_path / "src")
    _same_tensors(tmp_path / "out", tmp_path / "mem")


def _heads():
    import transformers as tf
    from helpers.exact_models import wav2vec2_config
    gpt2 = dict(vocab_size=101, n_embd=32, n_layer=2, n_head=4, n_positions=64, num_labels=3)
    return {
        "gpt2-classifier": (lambda: tf.GPT2ForSequenceClassification(tf.GPT2Config(pad_token_id=0, **gpt2)), "exact"),
        # no pad token: the model refuses batches of several rows, so the padded sample batch runs row by row
        "gpt2-classifier-no-pad": (lambda: tf.GPT2ForSequenceClassification(tf.GPT2Config(**gpt2)), "exact"),
        "opt-question-answering": (lambda: tf.OPTForQuestionAnswering(tf.OPTConfig(
            vocab_size=101, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, word_embed_proj_dim=32)), "exact"),
        "wav2vec2-classifier": (lambda: tf.Wav2Vec2ForSequenceClassification(
            wav2vec2_config(do_stable_layer_norm=True)),
                                "exact"),
        "bert-masked-lm": (lambda: tf.BertForMaskedLM(tf.BertConfig(
            vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64)), "naive"),   # post-LN
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2-classifier", "gpt2-classifier-no-pad", "opt-question-answering",
                                  "wav2vec2-classifier", "bert-masked-lm"])
def test_any_head_loads_with_its_own_class_and_converts(tmp_path, name):
    """config.architectures names the transformers class to build (not only LM/seq2seq/CTC/image heads), so
    its head's weights are loaded and converted, in memory and lazily alike."""
    make, method = _heads()[name]
    torch.manual_seed(0)
    built = perturb(make()).eval()
    built.save_pretrained(tmp_path / "src")
    model, _ = normswap.load_model(str(tmp_path / "src"))
    assert type(model) is type(built)
    report = normswap.convert(model, method="auto")
    assert report.method == method
    normswap.save_pretrained(model, tmp_path / "mem", source=tmp_path / "src")
    lazy_report, parity = lazy_convert.convert_folder(tmp_path / "src", tmp_path / "out", method="auto")
    assert lazy_report.method == method
    _same_tensors(tmp_path / "out", tmp_path / "mem")
    expected = compare(built, normswap.from_pretrained(tmp_path / "out"))
    assert parity.max_rel == pytest.approx(expected.max_rel, rel=1e-6)
    assert parity.max_rel <= 1e-5 if method == "exact" else parity.max_rel > 1e-2


@pytest.mark.slow
def test_a_decoder_that_cross_attends_converts_lazily_and_exactly(tmp_path):
    """The lazy path has no weights for a trial forward: whether MusicGen's decoder takes encoder states is
    checked on a meta skeleton, so its cross-attention norms are traced as in memory."""
    import transformers as tf
    torch.manual_seed(0)
    model = perturb(tf.MusicgenForCausalLM(tf.MusicgenDecoderConfig(
        num_codebooks=2, vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2)))
    model.save_pretrained(tmp_path / "src")
    report, parity = lazy_convert.convert_folder(tmp_path / "src", tmp_path / "out", method="exact")
    assert report.method == "exact" and "model.decoder.layers.1.encoder_attn_layer_norm" in \
        [r.name for r in report.converted]
    in_memory = normswap.load_model(str(tmp_path / "src"))[0]
    normswap.convert(in_memory, method="exact")
    assert compare(in_memory, normswap.from_pretrained(tmp_path / "out")).max_abs == 0.0


def test_verifying_the_staged_folder_does_not_warn_of_what_the_report_says(gpt2_dir, tmp_path):
    """Every load of an exact folder names its not-preserved outputs (issue 33 #11); the lazy path's verification of
    the folder it is writing is no user's load: the warning would name the hidden staging folder."""
    import warnings
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        report, _ = lazy_convert.convert_folder(gpt2_dir, tmp_path / "out")
    assert "hidden_states" in report.not_preserved
    assert [str(w.message) for w in seen if "keeps the original's outputs" in str(w.message)] == []
    with pytest.warns(UserWarning, match="keeps the original's outputs except hidden_states"):
        normswap.from_pretrained(tmp_path / "out")
