"""Fixtures shared by the whole suite; the models and helpers they use live in `helpers/`."""
from __future__ import annotations

import os
import signal

import pytest

from helpers.tiny import FAMILIES, tiny_model


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A tiny GPT-2 saved by transformers (an unconverted SRC folder)."""
    path = tmp_path_factory.mktemp("src") / "gpt2"
    tiny_model("gpt2").save_pretrained(path)
    return path


SESSION_SIGINT = signal.getsignal(signal.SIGINT)   # when pytest imports this file, before any test


def _log_sigint(what: str) -> None:
    if os.environ.get("NORMSWAP_SIGINT_LOG"):
        with open(os.environ["NORMSWAP_SIGINT_LOG"], "a") as f:
            f.write(f"{what}: {signal.getsignal(signal.SIGINT)!r}\n")


@pytest.fixture(autouse=True)
def _sigint_as_it_was(request):
    """Each test starts with the SIGINT handler the session started with (the tests of Ctrl-C handling need
    Python's own). Where it was changed, by a test or by what ran between tests (a fixture of wider scope, an
    import), that is named in $NORMSWAP_SIGINT_LOG and the handler restored."""
    if signal.getsignal(signal.SIGINT) is not SESSION_SIGINT:
        _log_sigint(f"before {request.node.nodeid}")
        signal.signal(signal.SIGINT, SESSION_SIGINT)
    yield
    if signal.getsignal(signal.SIGINT) is not SESSION_SIGINT:
        _log_sigint(request.node.nodeid)
        signal.signal(signal.SIGINT, SESSION_SIGINT)
