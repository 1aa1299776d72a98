"""An exported graph's behavioural fingerprint (`folder.fingerprint`, for ONNX), kept in the file's metadata under META
as JSON, and checked in onnxruntime by the export's validation and by `validate.check_fingerprint(path)`:

- `probe`: one input per graph input, by the graph's own names, encoded as `fingerprint.encode` encodes them
  (integers kept, floating inputs regenerated from a seed). A converted model's probe (its section's, set at
  conversion) where it maps onto the graph (`probe_from` "model"): each input the graph takes as recorded, the
  ones it lacks filled as the validation fills them (attention_mask all ones, position_ids counted from the mask
  as HF's generate counts them, an empty past). Else the export's own (`probe_from` "export"): token ids drawn as
  the validation draws them, or a module's first example batch.
- `outputs`: the digest of the fp32 PyTorch model's outputs on it, run in the wrapper the graph was traced from,
  by the graph's output names; `dtype`: the graph's (float32 | float16), whose tolerance the check uses.
- `saved`: for the export of a converted folder (`saved`, its recorded fingerprint), where the probe is that
  folder's exactly (nothing left out, nothing filled that the model would compute otherwise), the digest it
  recorded of the outputs the graph returns: the file is checked against the model that was saved, not only
  against the one it was exported from. Else `{"none": why}`.
- `{"none": why}` instead where no fingerprint can be taken (an int8 file is not exact by design).
"""
from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from normswap.errors import NormswapError, first_line
from normswap.export import wrap
from normswap.folder import fingerprint
from normswap.folder.schema import FingerprintFailed
from normswap.folder.attached import section

META = "normswap.fingerprint"
NO_ARGS = {"tuple": []}   # fingerprint.encode(()): every probe normswap records passes keywords only
INT8 = "an int8 quantization is not exact: its error was measured at export (the report's `quantized`)"


@dataclass
class Traced:
    """The graph in PyTorch: `run` (the fp32 model in the wrapper the graph was traced from) on `inputs`, giving
    `outputs`; `fill(given)` adds the inputs a probe lacks ({name: tensor}, why that is not what the model does
    without them, or None); `template` the non-tensor inputs the graph was traced with (None: none, only tensors
    by name); `own` the export's own probe."""
    run: nn.Module
    inputs: list[str]
    outputs: list[str]
    fill: Callable[[dict], tuple[dict, str | None]]
    template: object
    own: dict[str, torch.Tensor]


def for_hf(reference: nn.Module, wrapper: nn.Module, names: tuple[list[str], list[str]],
           own: dict[str, torch.Tensor], dtype: torch.dtype) -> Traced:
    """An HF model's graph (`wrap.Plain` / `wrap.WithPast` around `reference`); past inputs filled empty in `dtype`."""
    def fill(given: dict) -> tuple[dict, str | None]:
        ids = given["input_ids"]
        mask = given.get("attention_mask", torch.ones_like(ids))   # no mask: every token attended, as the model's
        out, why = {} if "attention_mask" in given else {"attention_mask": mask}, None
        if "position_ids" in names[0] and "position_ids" not in given:
            out["position_ids"] = wrap.position_ids(mask, ids.shape[1])
            if not bool((mask == 1).all()):   # the model's own positions count from the first column
                why = "its position_ids were counted from a padded attention_mask"
        past = [n for n in names[0] if n.startswith("past_key_values.")]
        if past:   # an empty past: what no cache computes
            shape = wrap.kv_shape(reference, ids.shape[0], 0)
            out.update({n: torch.zeros(shape, dtype=dtype) for n in past})
        return out, why
    return Traced(wrapper, names[0], names[1], fill, None, own)


def for_module(reference: nn.Module, batch: dict, outputs: list[str]) -> Traced:
    """A module's graph traced on `batch` (`wrap.Flat`): its inputs are that batch's tensors, nothing to fill."""
    own = dict(wrap.flat_inputs(batch))
    return Traced(wrap.Flat(reference, batch), list(own), outputs, lambda given: ({}, None), skeleton(batch), own)


def leaves(spec: dict, name: str = ""):
    """(dotted name, spec) of each tensor an encoded input holds, named as `parity.tensors` names tensors."""
    if "tensor" in spec:
        yield name, spec
    for k, v in spec.get("dict", {}).items():
        yield from leaves(v, f"{name}.{k}" if name else str(k))
    for i, v in enumerate(spec.get("list", spec.get("tuple", []))):
        yield from leaves(v, f"{name}.{i}" if name else str(i))


def skeleton(batch):
    """`batch` with its tensors left out (None): the other values it passes."""
    return wrap.substitute(batch, itertools.repeat(None))


def _fits(spec: dict, graph: tuple[str, list | None]) -> bool:
    """A recorded input the graph can take: the same kind (floating: any width, cast), every fixed dim equal."""
    kind, dims = graph
    floating = getattr(torch, spec["tensor"]).is_floating_point
    same = floating == getattr(torch, kind).is_floating_point and (floating or spec["tensor"] == kind)
    return same and (dims is None or len(dims) == len(spec["shape"]) and
                     all(d is None or d == n for d, n in zip(dims, spec["shape"])))


def mapped(traced: Traced, graph: dict[str, tuple[str, list]], probe) -> tuple[dict | None, str | None]:
    """(specs by graph input name, why they are not `probe` exactly: None where they are) of a model's probe
    mapped onto the graph's inputs; (None, why) where it does not map."""
    if not isinstance(probe, dict) or "kwargs" not in probe:
        return None, "the model carries no probe"
    if probe.get("args", NO_ARGS) != NO_ARGS:
        return None, "its probe passes positional inputs"
    given = dict(leaves(probe["kwargs"]))
    specs = {n: given[n] for n in traced.inputs if n in given}
    unfit = [n for n, s in specs.items() if n in graph and not _fits(s, graph[n])]
    if unfit or not specs:
        return None, f"its `{unfit[0]}` does not fit the graph" if unfit else "it has none of the graph's inputs"
    try:
        added, why = traced.fill(fingerprint.decode({"dict": specs}, "cpu", torch.float32))
    except KeyError as e:
        return None, f"it has no `{e.args[0]}`"
    specs.update({n: fingerprint.encode(t, 100 + i) for i, (n, t) in enumerate(added.items())})
    missing = [n for n in traced.inputs if n not in specs]
    if missing:
        return None, f"it has no `{missing[0]}`"
    dropped = [n for n in given if n not in traced.inputs]
    want = traced.template if traced.template is not None else dict.fromkeys(given)
    if dropped or skeleton(fingerprint.decode(probe["kwargs"], "cpu", torch.float32)) != want:
        why = f"the graph takes no `{dropped[0]}`" if dropped else "its probe passes other values than the graph"
    return {n: specs[n] for n in traced.inputs}, why


def own_specs(traced: Traced) -> dict:
    """The export's own probe, completed as a model's is, by graph input name."""
    added, _ = traced.fill(traced.own)
    feed = {**traced.own, **added}
    return {n: fingerprint.encode(feed[n], 200 + i) for i, n in enumerate(traced.inputs)}


@torch.no_grad()
def reference_digest(traced: Traced, specs: dict, dtype: torch.dtype) -> dict:
    """The digest of the PyTorch model's outputs on the probe as the graph gets it (floating inputs in the graph's
    `dtype`, then in the model's fp32), by the graph's output names."""
    device = next(traced.run.parameters()).device
    feed = fingerprint.decode({"dict": specs}, "cpu", dtype)
    args = [feed[n].to(device, torch.float32) if feed[n].is_floating_point() else feed[n].to(device)
            for n in traced.inputs]
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), fingerprint.exact_matmuls():
        torch.manual_seed(0)
        out = traced.run(*args)
    return fingerprint.digest(dict(zip(traced.outputs, out if isinstance(out, tuple) else (out,))))


def against_saved(saved: dict | None, inexact: str | None, outputs: dict) -> dict | None:
    """The `saved` entry: the folder's recorded digest of the graph's outputs, or why it cannot be checked."""
    if saved is None:
        return None
    if "outputs" not in saved:
        return {"none": saved.get("none") or "its folder recorded no digest"}
    common = {k: v for k, v in saved["outputs"].items() if k in outputs}
    if inexact or not common:
        return {"none": inexact or f"the graph returns none of the outputs its folder recorded "
                                   f"({', '.join(saved['outputs'])})"}
    return {"dtype": saved["dtype"], "outputs": common}


def model_probe(model: nn.Module, saved: dict | None) -> dict | None:
    """The recorded probe the graph's starts from: the folder's (`saved`), else the model's own (its section's)."""
    found = saved if saved is not None else (section(model) or {}).get("fingerprint")
    return found.get("probe") if isinstance(found, dict) else None


def _no_digest(e: Exception) -> str:
    return f"the PyTorch model gave no digest on its probe ({type(e).__name__}: {first_line(e)[:200]})"


def stamp(traced: Traced, onnx_model, probe: dict | None, dtype: str, saved: dict | None) -> dict:
    """The fingerprint to write into the metadata of the graph `onnx_model` (an onnx_ir Model; see the module
    docstring)."""
    specs, inexact = mapped(traced, graph_inputs(onnx_model), probe)
    source = "model"
    if specs is not None:
        try:
            outputs = reference_digest(traced, specs, getattr(torch, dtype))
        except Exception as e:   # the model's probe does not run through the graph's wrapper: the export's own
            specs, inexact = None, _no_digest(e)
    if specs is None:
        try:
            specs, source = own_specs(traced), "export"
            outputs = reference_digest(traced, specs, getattr(torch, dtype))
        except Exception as e:
            return {"none": _no_digest(e)}
    if not outputs:
        return {"none": "the model returns no floating tensor"}
    found = {"probe": {"dict": specs}, "probe_from": source, "dtype": dtype, "outputs": outputs}
    if (entry := against_saved(saved, inexact, outputs)) is not None:
        found["saved"] = entry
    return found


def graph_inputs(model) -> dict[str, tuple[str, list | None]]:
    """name -> (dtype name, dims: None where dynamic; None where unknown) of an onnx_ir model's inputs."""
    return {v.name: (str(v.dtype.numpy()), None if v.shape is None else
                     [d if isinstance(d, int) else None for d in v.shape]) for v in model.graph.inputs}


def read(metadata: dict[str, str], where: str) -> dict | None:
    """The fingerprint in a graph's metadata; None where it has none."""
    raw = metadata.get(META)
    try:
        found = None if raw is None else json.loads(raw)
    except ValueError:
        found = None
    if raw is not None and not isinstance(found, dict):
        raise NormswapError(f"{where}: its `{META}` metadata is not a fingerprint")
    return found


def holds(sess, where: str) -> str | None:
    """Run the fingerprint in the session's metadata through it (and the folder's digest it keeps): None where it
    holds, why not where there is nothing to check; FingerprintFailed where it does not hold."""
    found = read(sess.get_modelmeta().custom_metadata_map, where)
    if found is None or "outputs" not in found:
        return "exported without one (by an older normswap, or not by normswap)" if found is None else \
            str(found.get("none"))
    try:
        dtype = getattr(torch, found["dtype"])
        feed = fingerprint.decode(found["probe"], "cpu", dtype)
        feed = {i.name: feed[i.name].numpy() for i in sess.get_inputs()}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise NormswapError(f"{where}: its `{META}` metadata is not a fingerprint") from None
    try:
        got = sess.run(None, feed)
    except Exception as e:
        raise FingerprintFailed(f"{where}: onnxruntime cannot run its fingerprint's probe ({first_line(e)[:200]})") \
            from None
    out = {o.name: torch.from_numpy(np.asarray(v)) for o, v in zip(sess.get_outputs(), got)}
    if why := fingerprint.mismatch(found, out, dtype):
        raise FingerprintFailed(f"{where} does not reproduce its fingerprint, the PyTorch model's outputs on its "
                                f"probe ({why})")
    saved = found.get("saved") or {}
    if "outputs" in saved and (why := fingerprint.mismatch(saved, out, dtype)):
        raise FingerprintFailed(f"{where} does not reproduce the outputs its model's folder recorded on the same "
                                f"probe ({why}): the model exported is not the model that was saved")
    return None


def rewrite(path, found: dict) -> None:
    """Replace the fingerprint in the ONNX file `path`'s metadata (its external data, if any, left as it is)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, META: json.dumps(found)})
    onnx.save(model, str(path))


def summary(found: dict) -> dict:
    """What the report says of a fingerprint: its probe's origin, outputs and dtype, and the folder's digest kept."""
    if "outputs" not in found:
        return {"none": found["none"]}
    saved = found.get("saved")
    return {"probe_from": found["probe_from"], "outputs": list(found["outputs"]), "dtype": found["dtype"],
            "tolerance": fingerprint.tolerance(found["dtype"]),
            "saved": saved if saved is None or "none" in saved else list(saved["outputs"])}
