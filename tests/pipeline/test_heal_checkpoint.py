"""`heal_checkpoint`: heal a saved converted model towards its original and save it, from Python."""
from __future__ import annotations

import json

import pytest
from helpers.heal_models import save_pair, text, tokenizer

import normswap
from normswap.errors import NormswapError
from normswap.healing.options import HealOptions
from normswap.pipeline import HealCheckpointOptions, heal_checkpoint
from normswap.pipeline.heal import partial_beside

FAST = HealOptions(steps=2, seq_len=16, batch_size=2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("heal"), tokenizer(), text(600))


def test_heals_and_saves_out_with_its_log(saved, tmp_path):
    options = HealCheckpointOptions(teacher=str(saved / "orig"), data=(str(saved / "train.txt"),), heal=FAST,
                                    device="cpu")
    result = heal_checkpoint(str(saved / "conv"), tmp_path / "out", options)
    report = result.report
    assert result.main_process and result.plotted is None
    assert (report.steps_done, report.steps, report.interrupted) == (2, 2, False)
    assert report.saved_to == str(tmp_path / "out")
    log = json.loads((tmp_path / "out" / "heal_log.json").read_text())
    assert log["steps_done"] == 2 and log["loss_first"] == pytest.approx(report.loss_first)
    assert normswap.load(tmp_path / "out")[0].config.normswap_heal["steps_done"] == 2


def test_objective_lm_needs_no_teacher(saved, tmp_path):
    heal = HealOptions(steps=1, seq_len=16, batch_size=2, objective="lm")
    result = heal_checkpoint(str(saved / "conv"), tmp_path / "out",
                             HealCheckpointOptions(data=(str(saved / "train.txt"),), heal=heal))
    assert result.report.steps_done == 1 and (tmp_path / "out" / "config.json").exists()


@pytest.mark.parametrize("options, message", [
    (HealCheckpointOptions(data=("x.txt",)), "teacher ORIG is required for distillation (or use objective='lm')"),
    (HealCheckpointOptions(teacher="normswap-demo"), "data FILE is required: plain text to heal on"),
])
def test_missing_inputs_are_refused_before_loading(tmp_path, options, message):
    with pytest.raises(NormswapError) as e:
        heal_checkpoint("normswap-demo", tmp_path / "out", options)
    assert str(e.value) == message
    assert list(tmp_path.iterdir()) == []


def test_partial_goes_beside_out_unless_that_is_an_input(tmp_path):
    out = tmp_path / "out"
    assert partial_beside(str(out), [("`src`", "normswap-demo")]) == tmp_path / "out.partial"
    (tmp_path / "out.partial").mkdir()
    assert partial_beside(str(out), [("`src`", str(tmp_path / "out.partial"))]) == tmp_path / "out.partial-2"
