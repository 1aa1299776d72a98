"""Loading refuses what would give a wrong model or run someone else's code (issue 13: 2, 3, 8, 9, 10)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

import normswap
from normswap.folder.shipped import original_class
from normswap.folder import schema
from normswap.cli import main
from normswap.errors import NormswapError
from normswap.io.safetensors import weights_names
from normswap.models.load import load_model

from helpers.tiny import tiny_model

WEIGHTS = "model.safetensors"


def weights_file(folder: Path) -> Path:
    """The file its loaders read: a source's model.safetensors, a converted folder's "normswap" variant."""
    return folder / weights_names(folder)[0]


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def edit_weights(folder: Path, drop=(), add=None) -> None:
    state = safetensors.torch.load_file(weights_file(folder))
    for k in drop:
        del state[k]
    state.update(add or {})
    safetensors.torch.save_file(state, weights_file(folder), metadata={"format": "pt"})


def edit_config(folder: Path, fn, rehash: bool = False) -> None:
    config = json.loads((folder / "config.json").read_text())
    fn(config)
    if rehash:  # a consistent but wrong section: what only validation can catch
        config["normswap"]["checksum"] = schema.checksum(config["normswap"], folder)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture
def gpt2_dir(tmp_path):
    tiny_model("gpt2").save_pretrained(tmp_path / "src")
    return tmp_path / "src"


# -- 13.2: a SRC's load report is an error, not a silently random model ------------------------------

def test_plain_folder_with_tied_head_loads_without_complaint(gpt2_dir, capsys):
    model, _ = load_model(str(gpt2_dir))
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: not reported missing
    original = tiny_model("gpt2").transformer.h[0].attn.c_attn.weight
    assert torch.equal(model.transformer.h[0].attn.c_attn.weight, original)
    assert "warning" not in capsys.readouterr().err


def test_missing_tensor_fails_convert_naming_it(gpt2_dir, tmp_path):
    edit_weights(gpt2_dir, drop=["transformer.h.0.attn.c_attn.weight"])
    result = run("convert", gpt2_dir, "--to", "rmsnorm", "-o", tmp_path / "out")
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "1 missing (transformer.h.0.attn.c_attn.weight)" in lines[0], result.output
    assert "--allow-missing-weights" in lines[0] and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_allow_missing_weights_loads_anyway_with_a_warning(gpt2_dir, tmp_path):
    edit_weights(gpt2_dir, drop=["transformer.h.0.attn.c_attn.weight"])
    result = run("convert", gpt2_dir, "--to", "rmsnorm", "--method", "naive", "-o", tmp_path / "out",
                 "--allow-missing-weights")
    assert result.exit_code == 0, result.output
    assert "warning:" in result.output and "transformer.h.0.attn.c_attn.weight" in result.output
    assert weights_file(tmp_path / "out").exists()
    strict = run("inspect", gpt2_dir)  # the next command, without the flag, is strict again
    assert strict.exit_code == 1 and "1 missing (transformer.h.0.attn.c_attn.weight)" in strict.output


def test_config_with_more_layers_than_weights(gpt2_dir):
    edit_config(gpt2_dir, lambda c: c.update(n_layer=3))
    with pytest.raises(NormswapError, match=r"missing \(transformer\.h\.2\.") as e:
        load_model(str(gpt2_dir))
    assert "and 7 more" in str(e.value)  # 12 tensors in block 2: five named, the count of the rest


def test_unexpected_and_wrong_shaped_tensors_are_named(gpt2_dir):
    edit_weights(gpt2_dir, add={"extra.w": torch.zeros(3), "transformer.h.1.mlp.c_fc.bias": torch.zeros(5)})
    with pytest.raises(NormswapError) as e:
        load_model(str(gpt2_dir))
    msg = str(e.value)
    assert "1 unexpected (extra.w)" in msg
    assert "1 of the wrong shape (transformer.h.1.mlp.c_fc.bias (5,) in the file, (128,) in the model)" in msg
    assert "report" not in msg and "\n" not in msg


def test_config_with_fewer_layers_reports_unexpected(gpt2_dir):
    edit_config(gpt2_dir, lambda c: c.update(n_layer=1))
    with pytest.raises(NormswapError, match=r"1\d unexpected \(transformer\.h\.1\."):
        load_model(str(gpt2_dir))


# -- 13.9: a converted folder whose weights do not match -------------------------------------------

@pytest.fixture(scope="module")
def converted_once(tmp_path_factory):
    model = tiny_model("gpt2")
    normswap.convert(model, to="rmsnorm", method="exact")
    folder = tmp_path_factory.mktemp("conv") / "conv"
    normswap.save_pretrained(model, folder)
    return folder, model


@pytest.fixture
def converted(converted_once, tmp_path):
    """A fresh copy of one exact-converted GPT-2 folder (each test edits its own)."""
    folder, model = converted_once
    return Path(shutil.copytree(folder, tmp_path / "conv")), model


def test_from_pretrained_names_missing_and_unexpected_tensors(converted):
    folder, _ = converted
    edit_weights(folder, drop=["transformer.ln_f.weight"], add={"stray": torch.ones(2)})
    with pytest.raises(NormswapError) as e:
        normswap.from_pretrained(folder)
    assert "1 missing (transformer.ln_f.weight)" in str(e.value) and "1 unexpected (stray)" in str(e.value)


def test_from_pretrained_refuses_a_different_weights_file_with_the_same_names(converted):
    folder, _ = converted
    state = safetensors.torch.load_file(weights_file(folder))
    state["transformer.ln_f.weight"] = state["transformer.ln_f.weight"].half()  # same name, shape: new header
    safetensors.torch.save_file(state, weights_file(folder), metadata={"format": "pt"})
    with pytest.raises(NormswapError, match="are not the ones saved with this config"):
        normswap.from_pretrained(folder)


# -- 13.3: the normswap section is validated and checksummed -------------------------------------------

NORM = "transformer.h.0.ln_1"


def _norm(c):
    return c["normswap"]["norms"][NORM]


REHASHED = [
    (lambda c: c["normswap"]["norms"].update({"transformer.h.9.ln_1": dict(_norm(c))}),
     "names module 'transformer.h.9.ln_1', which the GPT2LMHeadModel model does not have"),
    (lambda c: c["normswap"]["output_fixes"].update({"transformer.nope": {"centre": True, "bias": 0}}),
     "names module 'transformer.nope'"),
    (lambda c: c["normswap"]["base"].update(architecture="os"), "unknown architecture 'os'"),
    (lambda c: c["normswap"]["base"].update(model_type="nope"), "unknown model_type 'nope'"),
    (lambda c: _norm(c).update(eps=float("inf")), "eps = inf must be finite and > 0"),
]


CHECKED = [
    (lambda c: _norm(c).update(eps=-1e-5), "eps = -1e-05 must be finite and > 0"),
    (lambda c: _norm(c).update(eps=0), "eps = 0 must be finite and > 0"),
    (lambda c: _norm(c).update(eps=float("nan")), "eps = nan must be finite and > 0"),
    (lambda c: _norm(c).update(eps="nan"), "eps = 'nan' is not an integer or a number"),
    (lambda c: _norm(c).update(type="layernorm"), "type = 'layernorm' is not one of rmsnorm, prmsnorm"),
    (lambda c: _norm(c).update(type="prmsnorm", p=0), "p = 0 must be in (0, 1]"),
    (lambda c: _norm(c).update(type="prmsnorm", p=1.5), "p = 1.5 must be in (0, 1]"),
    (lambda c: _norm(c).update(width=True), "width = True is not an integer"),
    (lambda c: _norm(c).pop("eps"), f"norms['{NORM}'] has no 'eps'"),
    (lambda c: c["normswap"].update(format=99), "normswap format 99 is not supported"),
    (lambda c: c["normswap"].pop("format"), "normswap format None is not supported"),
    (lambda c: c["normswap"].update(format=1), "written by transformers' own save_pretrained"),
    (lambda c: c["normswap"].update(norms=[]), "section.norms = [] is not an object"),
    (lambda c: c["normswap"]["output_fixes"].update(x={"centre": "yes", "bias": 0}), "centre = 'yes' is not"),
    (lambda c: c["normswap"].pop("checksum"), "section has no checksum"),
    (lambda c: _norm(c).update(eps=1e-3), "section of config.json was edited after normswap saved it"),
    (lambda c: c["normswap"]["output_fixes"].popitem(), "section of config.json was edited after normswap saved it"),
]


@pytest.mark.parametrize("edit,message,rehash", [(*c, False) for c in CHECKED] + [(*c, True) for c in REHASHED])
def test_bad_section_is_refused_with_one_line(converted, edit, message, rehash):
    folder, _ = converted
    edit_config(folder, edit, rehash)
    with pytest.raises(NormswapError) as e:
        normswap.from_pretrained(folder)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_removed_output_fix_is_detected(converted):
    folder, model = converted
    config = json.loads((folder / "config.json").read_text())
    assert config["normswap"]["output_fixes"], "exact GPT-2 records output fixes"
    edit_config(folder, lambda c: c["normswap"]["output_fixes"].popitem())
    result = run("inspect", folder)
    assert result.exit_code == 1 and "edited after normswap saved it" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_checksum_covers_section_and_weights_header(converted):
    folder, model = converted
    section = json.loads((folder / "config.json").read_text())["normswap"]
    assert section["format"] == schema.FORMAT and section["base"] == {"architecture": "GPT2LMHeadModel",
                                                                      "model_type": "gpt2"}
    assert section["checksum"] == schema.checksum(section, folder)
    other = dict(section, added_biases=["transformer.wte"])
    assert schema.checksum(other, folder)["section"] != section["checksum"]["section"]
    inputs = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(normswap.from_pretrained(folder)(inputs).logits, model(inputs).logits)


# -- 13.8: no code from a model folder runs unless asked, and nothing prompts ------------------------------

CUSTOM_CODE = """
import pathlib
pathlib.Path({marker!r}).write_text("ran")
from transformers import GPT2Config, GPT2LMHeadModel
class XConfig(GPT2Config):
    model_type = "x-custom"
class XModel(GPT2LMHeadModel):
    config_class = XConfig
"""


def _custom_code_folder(folder: Path, marker: Path, model_type: str) -> None:
    tiny_model("gpt2").save_pretrained(folder)
    for name in ("configuration_x.py", "modeling_x.py"):
        (folder / name).write_text(CUSTOM_CODE.format(marker=str(marker)))
    edit_config(folder, lambda c: c.update(model_type=model_type, auto_map={
        "AutoConfig": "configuration_x.XConfig", "AutoModel": "modeling_x.XModel",
        "AutoModelForCausalLM": "modeling_x.XModel"}))


def _cli(tmp_path, *args, stdin: str):
    """`normswap ARGS` in a fresh process, stdin a pipe (where transformers would prompt)."""
    env = dict(os.environ, PYTHONPATH=str(Path(normswap.__file__).parent.parent), HF_HUB_OFFLINE="1",
               HF_MODULES_CACHE=str(tmp_path / "modules"))  # trusted code is copied there, not to ~/.cache
    return subprocess.run([sys.executable, "-m", "normswap", *map(str, args)], input=stdin, text=True,
                          capture_output=True, env=env, timeout=120)


@pytest.mark.slow
def test_remote_code_runs_only_with_the_flag(tmp_path):
    _custom_code_folder(tmp_path / "src", tmp_path / "marker", "x-custom")
    result = _cli(tmp_path, "inspect", tmp_path / "src", stdin="y\n")
    assert not (tmp_path / "marker").exists(), "the folder's code ran without --trust-remote-code"
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "--trust-remote-code" in result.stderr, result.stderr
    assert "[y/N]" not in result.stdout + result.stderr
    result = _cli(tmp_path, "inspect", tmp_path / "src", "--trust-remote-code", stdin="")
    assert (tmp_path / "marker").exists() and result.returncode == 0, result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["x-custom", "gpt2"])   # gpt2: a type transformers also knows
def test_folders_with_their_own_code_are_never_converted(tmp_path, model_type):
    """Issue 18.5: with the flag, the in-memory path wrote the folder's auto_map and no modeling file (plain
    transformers then built the LayerNorm class: rel 0.32), streaming ignored the flag, and a known model_type
    was silently converted as transformers' class. Now: loaded only with the flag, as the folder's own class;
    converted never (the converted folder could not be rebuilt without that code), before anything is written."""
    _custom_code_folder(tmp_path / "src", tmp_path / "marker", model_type)
    with pytest.raises(NormswapError, match="runs only with trust_remote_code=True"):
        load_model(str(tmp_path / "src"))
    assert not (tmp_path / "marker").exists()
    model, _ = load_model(str(tmp_path / "src"), trust_remote_code=True)
    assert type(model).__name__ == "XModel" and (tmp_path / "marker").exists()
    normswap.convert(model, method="exact")   # in Python, in memory: fine; saving it is not
    with pytest.raises(NormswapError, match="not a transformers class"):
        normswap.save_pretrained(model, tmp_path / "api")
    for flags in ([], ["--trust-remote-code"]):
        result = _cli(tmp_path, "convert", tmp_path / "src", "--to", "rmsnorm", "-o", tmp_path / "out", *flags,
                      stdin="y\n")
        assert result.returncode == 1 and "ships its own model code" in result.stderr, result.stderr
        assert result.stderr.strip().count("\n") == 0
    assert not (tmp_path / "api").exists() and not (tmp_path / "out").exists()


def test_normswap_folder_with_auto_map_loads_without_its_code(converted, tmp_path):
    folder, model = converted
    marker = tmp_path / "marker"
    for name in ("configuration_x.py", "modeling_x.py"):
        (folder / name).write_text(CUSTOM_CODE.format(marker=str(marker)))
    # What an interop folder looks like: its own model_type and classes (config.json is outside the checksum).
    edit_config(folder, lambda c: c.update(model_type="x-custom", architectures=["XModel"], auto_map={
        "AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"}))
    loaded, _ = load_model(str(folder))
    assert not marker.exists()
    assert original_class(loaded).__name__ == "GPT2LMHeadModel"
    inputs = torch.tensor([[5, 6, 7]])
    assert torch.equal(loaded(inputs).logits, model(inputs).logits)


class _Payload:
    """A pickle that writes a file when loaded: what a hostile pytorch_model.bin can hold."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "ran"))


def test_pickled_checkpoint_is_loaded_weights_only(tmp_path):
    tiny_model("gpt2").config.save_pretrained(tmp_path / "src")
    torch.save({"transformer.wte.weight": _Payload(tmp_path / "marker")}, tmp_path / "src" / "pytorch_model.bin")
    with pytest.raises(NormswapError, match="cannot load model from"):
        load_model(str(tmp_path / "src"))
    assert not (tmp_path / "marker").exists()


# -- 13.10: output folders honour the umask ---------------------------------------------------------------

@pytest.mark.skipif(os.name != "posix", reason="POSIX modes")
@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_saved_folder_mode_follows_umask(tmp_path, mask):
    model = tiny_model("gpt2")
    normswap.convert(model, to="rmsnorm", method="naive")
    old = os.umask(mask)
    try:
        normswap.save_pretrained(model, tmp_path / "m")
    finally:
        os.umask(old)
    assert (tmp_path / "m").stat().st_mode & 0o777 == 0o777 & ~mask



@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_a_bogus_llava_strategy_is_refused_with_the_whole_reason(tmp_path, command):
    """Issue 33 #20: the reason was cut off after "Validation error for field 'vision_feature_select_strategy':"."""
    import transformers as tf
    vision = tf.CLIPVisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                 image_size=16, patch_size=8)
    text = tf.LlamaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                          intermediate_size=32, max_position_embeddings=32)
    tf.LlavaForConditionalGeneration(tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=30,
                                                    vision_feature_layer=-1)).save_pretrained(tmp_path / "llava")
    edit_config(tmp_path / "llava", lambda c: c.update(vision_feature_select_strategy="bogus"))
    result = run(command, tmp_path / "llava", *(["--to", "rmsnorm", "-o", tmp_path / "out"] * (command == "convert")))
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert lines[0].startswith(f"error: cannot load model from {tmp_path / 'llava'}: Validation error for field "
                               "'vision_feature_select_strategy': ")
    assert lines[0].endswith("got bogus")
    assert not (tmp_path / "out").exists()
