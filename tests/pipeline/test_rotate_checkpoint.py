"""`rotate_checkpoint`: its options are one frozen object; bad ones fail before any load, writing nothing."""
import dataclasses

import pytest

import normswap
from normswap.errors import NormswapError


def test_options_are_frozen_and_bad_ones_fail_before_any_work(tmp_path):
    options = normswap.RotateOptions(method="random", seed=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.seed = 4
    with pytest.raises(NormswapError, match="unknown rotation method 'givens'"):
        normswap.rotate_checkpoint("normswap-demo", tmp_path / "o", normswap.RotateOptions(method="givens"))
    with pytest.raises(NormswapError, match="shard"):
        normswap.rotate_checkpoint("normswap-demo", tmp_path / "o", normswap.RotateOptions(max_shard_size="lots"))
    assert not (tmp_path / "o").exists()


def test_the_demo_itself_is_refused_until_converted(tmp_path):
    with pytest.raises(NormswapError, match=r"transformer\.h\.0\.ln_1 \(LayerNorm\) is a LayerNorm: convert"):
        normswap.rotate_checkpoint("normswap-demo", tmp_path / "o")
    assert not (tmp_path / "o").exists()
