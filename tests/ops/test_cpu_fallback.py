"""Where the C++ CPU kernel cannot be built, the PyTorch path runs and normswap warns once per machine; one
built at install time (setup.py) is used without a build."""
from __future__ import annotations

import warnings

import pytest
import torch

from normswap import RMSNorm, ops
from normswap.ops import cpu, reference


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process that has not tried to build yet, with an empty cache; restored afterwards."""
    monkeypatch.delenv("NORMSWAP_BACKEND", raising=False)
    monkeypatch.setenv("NORMSWAP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu, "build_key", lambda flags: "test")  # not the module this process loaded
    cpu.extension.cache_clear()
    monkeypatch.setattr(ops, "_eager_module", ops._eager_module.__wrapped__)
    yield tmp_path
    cpu.extension.cache_clear()


def run_twice():
    norm, x = RMSNorm(48), torch.randn(3, 48)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [norm(x), norm(x, residual=x)]
    expected = [reference.rms_norm_reference(x, norm.weight, norm.eps),
                reference.rms_norm_reference(x, norm.weight, norm.eps, residual=x)]
    return caught, outs, expected


def assert_pytorch_path(outs, expected):
    assert torch.equal(outs[0], expected[0])  # bit-identical: it *is* the reference
    assert all(torch.equal(a, b) for a, b in zip(outs[1], expected[1]))


def test_build_failure_falls_back_with_one_warning(fresh, monkeypatch):
    def broken():
        raise RuntimeError("Error building extension 'normswap_cpu': g++ exited with 1\nmore log")
    monkeypatch.setattr(cpu, "build", broken)
    caught, outs, expected = run_twice()
    messages = [str(w.message) for w in caught if "fast CPU RMSNorm" in str(w.message)]
    assert messages == ["normswap: the fast CPU RMSNorm is unavailable (Error building extension "
                        "'normswap_cpu': g++ exited with 1); using the slower PyTorch path"]
    assert_pytorch_path(outs, expected)
    assert ops.resolve_backend(torch.zeros(2, 4)) == "torch"


def test_missing_toolchain_is_reported(fresh, monkeypatch):
    monkeypatch.setattr(cpu.shutil, "which", lambda tool: None)
    caught, outs, expected = run_twice()
    messages = [str(w.message) for w in caught if "fast CPU RMSNorm" in str(w.message)]
    assert len(messages) == 1 and "not found (a C++ compiler and `pip install ninja`)" in messages[0]
    assert_pytorch_path(outs, expected)


def test_an_earlier_compile_failure_is_not_retried(fresh, monkeypatch):
    (fresh / "cpu-test").mkdir()
    (fresh / "cpu-test" / "failed").write_text("RuntimeError: compile error\n")
    monkeypatch.setattr(cpu, "_compile", lambda *a: pytest.fail("rebuilt after a recorded failure"))
    with pytest.warns(RuntimeWarning, match="an earlier build failed"):
        assert cpu.extension() is None


def test_explicit_cpu_backend_refuses_to_fall_back(fresh, monkeypatch):
    monkeypatch.setattr(cpu, "build", lambda: (_ for _ in ()).throw(RuntimeError("no compiler")))
    monkeypatch.setenv("NORMSWAP_BACKEND", "cpu")
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="NORMSWAP_BACKEND=cpu"):
        RMSNorm(8)(torch.randn(2, 8))


def test_a_compile_error_is_recorded_once(fresh, monkeypatch):
    from torch.utils import cpp_extension

    def fail(*args, **kwargs):
        raise RuntimeError("Error building extension 'normswap_cpu_test':\nkernels.cpp:1: error: boom")
    monkeypatch.setattr(cpp_extension, "load", fail)
    monkeypatch.setattr(cpu.shutil, "which", lambda tool: "/usr/bin/" + tool)  # a toolchain "is" there
    with pytest.warns(RuntimeWarning, match="the build failed, log: .*failed"):
        assert cpu.extension() is None
    log = fresh / "cpu-test" / "failed"
    assert "error: boom" in log.read_text()


def test_the_warning_comes_once_per_machine_not_per_command(fresh, monkeypatch):
    monkeypatch.setattr(cpu.shutil, "which", lambda tool: None)
    with pytest.warns(RuntimeWarning, match="fast CPU RMSNorm is unavailable"):
        assert cpu.extension() is None
    cpu.extension.cache_clear()   # a later command: a new process
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu.extension() is None


def test_the_extension_built_at_install_is_used_without_a_build(fresh, monkeypatch):
    """setup.py's module, named by the build key, is imported; one of another key is never imported."""
    import sys
    import types

    built = types.ModuleType("normswap.ops._cpu_test")
    monkeypatch.setitem(sys.modules, "normswap.ops._cpu_test", built)
    monkeypatch.setattr(cpu.importlib.util, "find_spec", lambda name: object() if name.endswith("_cpu_test") else None)
    monkeypatch.setattr(cpu, "_compile", lambda *a: pytest.fail("built although installed"))
    assert cpu.build() is built
    monkeypatch.setattr(cpu, "build_key", lambda flags: "other")
    monkeypatch.setattr(cpu.shutil, "which", lambda tool: None)
    with pytest.raises(RuntimeError, match="not found"):
        cpu.build()
