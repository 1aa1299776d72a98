"""Issue 46.3: every family transformers 5 renames when loading (its checkpoint conversion table: VideoMAE's
q_bias is its query.bias) that normswap converts exactly (helpers/renamed_models.py, chosen by
benchmarks/renamed.py). Each is converted and saved by normswap and by transformers' own save path; each folder
loads as the original in normswap, in plain transformers 5 in a child that cannot import normswap, and in plain
transformers 4.57 (this file run again with NORMSWAP_PLAIN_PYTHON, as the Makefile does), or is refused there
where 4.57 cannot load the original either (helpers/plain.py: test_shipped.py's check)."""
from __future__ import annotations

import pytest

from helpers.plain import check_loads, convert_all
from helpers.renamed_models import CASES, build

pytestmark = pytest.mark.slow   # 73 families converted, saved twice, loaded in child processes


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("renamed")
    return root, convert_all(root, {name: (lambda n=name: build(n)) for name in CASES})


def test_every_renamed_family_loads_as_the_original_in_normswap_and_plain_transformers(converted, monkeypatch):
    monkeypatch.setenv("NORMSWAP_BACKEND", "torch")   # the shipped file's arithmetic on normswap's side too
    failures = check_loads(*converted)
    assert not failures, "\n".join(failures)
