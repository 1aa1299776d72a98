"""Checks run on every exported file before it is moved into place: onnx.checker, ORT loads it on
CPU, fused norm nodes in the ORT-optimised graph vs norms in the model, parity with PyTorch at two
batch/sequence sizes, greedy generation with the past (with_past: one prompt, and a left-padded batch
of prompts of different lengths, each row equal to PyTorch and to the prompt run alone), and ORT
latency. A module exported on example inputs (`validate_module`): the same file checks, fused nodes vs the
norms its forward calls, parity of every output on each example batch and on the first with each dynamic
dim doubled in turn. Both also run the fingerprint the export wrote into the file's metadata (`onnx_fingerprint`):
`check_fingerprint(path)` runs it on any file normswap exported."""
from __future__ import annotations

import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from normswap.errors import NormswapError, first_line
from normswap.export import fuse, onnx_fingerprint, translate, wrap
from normswap.export.norm_nodes import check_fused, constant_calls, norm_calls, norm_kinds
from normswap.parity import tensors

SIZES = ((1, 7), (3, 33))


PADDED_PROMPTS = (3, 8, 5)   # prompt lengths of the left-padded generation batch


def session(path: str | Path, level: str = "all", optimized_to: str | None = None,
            profile_prefix: str | None = None, threads: int = 0):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = {"extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                                     "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[level]
    opts.log_severity_level = 3
    opts.intra_op_num_threads = threads
    if optimized_to:
        opts.optimized_model_filepath = optimized_to
        # A model with external data needs its optimised copy's weights outside too (2 GB limit).
        opts.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                      Path(optimized_to).name + ".data")
    if profile_prefix:
        opts.enable_profiling, opts.profile_file_prefix = True, profile_prefix
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def check_file(path: Path) -> None:
    translate.register_ort_schema()
    onnx.checker.check_model(str(path), full_check=True)


def optimized_norm_nodes(path: Path) -> dict[str, int]:
    """Fused norm nodes after onnxruntime's own graph optimisations (what actually runs)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "optimized.onnx")
        session(path, "extended", optimized_to=out)
        return dict(fuse.norm_nodes(onnx.load(out, load_external_data=False)))


def random_inputs(model: nn.Module, batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Token ids and a mask whose later rows are right-padded (padding must not matter)."""
    g = torch.Generator().manual_seed(seed + 1000 * batch + seq)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1:, seq - seq // 4:] = 0
    return {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}


def empty_past(model: nn.Module, batch: int, np_dtype) -> dict[str, np.ndarray]:
    names, _ = wrap.io_names(wrap.num_layers(model.config), True, "logits")
    shape = wrap.kv_shape(model, batch, 0)
    return {n: np.zeros(shape, np_dtype) for n in names if n.startswith("past_key_values.")}


def with_positions(sess, feed: dict[str, np.ndarray], new: int | None = None) -> dict[str, np.ndarray]:
    """Add HF's position_ids (from the attention mask, for the last `new` tokens) if the graph takes them."""
    if any(i.name == "position_ids" for i in sess.get_inputs()):
        mask = feed["attention_mask"]
        feed["position_ids"] = wrap.position_ids(mask.copy(), mask.shape[1] if new is None else new)
    return feed


@torch.no_grad()
def outputs(sess, reference: nn.Module, output: str, with_past: bool, np_dtype):
    """Per (batch, seq) of SIZES, on random inputs: (batch, seq, ORT's main output, PyTorch's, the unpadded
    positions' mask), both outputs float64 numpy."""
    for batch, seq in SIZES:
        feed = with_positions(sess, random_inputs(reference, batch, seq))
        if with_past:
            feed.update(empty_past(reference, batch, np_dtype))
        got = sess.run([output], feed)[0].astype(np.float64)
        dev = next(reference.parameters()).device
        ref = getattr(reference(input_ids=torch.from_numpy(feed["input_ids"]).to(dev),
                                attention_mask=torch.from_numpy(feed["attention_mask"]).to(dev), use_cache=False),
                      output).double().cpu().numpy()
        yield batch, seq, got, ref, feed["attention_mask"].astype(bool)


def parity(sess, reference: nn.Module, output: str, with_past: bool, np_dtype) -> list[dict]:
    """max |ORT - PyTorch| of the main output over unpadded positions, per (batch, seq)."""
    rows = []
    for batch, seq, got, ref, keep in outputs(sess, reference, output, with_past, np_dtype):
        diff = np.abs(got[keep] - ref[keep])
        rows.append({"batch": batch, "seq": seq, "max_abs": float(diff.max()),
                     "ref_max": float(np.abs(ref[keep]).max()), "finite": bool(np.isfinite(got).all())})
    return rows


def ort_greedy(sess, model: nn.Module, prompt: np.ndarray, new_tokens: int, np_dtype,
               mask: np.ndarray | None = None, positions=None) -> np.ndarray:
    """Greedy decoding in ORT as optimum's ORTModelForCausalLM runs it: `present` fed back as the next
    step's past, the mask grown by one per step, position_ids from the mask (left padding allowed)."""
    tokens, step_ids = prompt, prompt
    mask = np.ones(prompt.shape, np.int64) if mask is None else mask.astype(np.int64)
    feed_past = empty_past(model, prompt.shape[0], np_dtype)
    names = list(feed_past)
    for _ in range(new_tokens):
        feed = (positions or with_positions)(sess, {"input_ids": step_ids, "attention_mask": mask},
                                             step_ids.shape[1])
        outs = sess.run(None, {**feed, **feed_past})
        step_ids = outs[0][:, -1].argmax(-1)[:, None].astype(np.int64)
        feed_past = dict(zip(names, outs[1:]))
        tokens = np.concatenate([tokens, step_ids], axis=1)
        mask = np.concatenate([mask, np.ones_like(step_ids)], axis=1)
    return tokens


def torch_greedy(reference: nn.Module, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> np.ndarray:
    """Plain greedy decoding, whatever the model's generation_config asks (sampling, penalties, eos lists
    would make PyTorch differ from the plain ORT loop it is compared with): that config is set aside."""
    from transformers import GenerationConfig
    dev = next(reference.parameters()).device
    own, reference.generation_config = reference.generation_config, GenerationConfig()
    try:
        out = reference.generate(ids.to(dev), attention_mask=mask.to(dev), generation_config=GenerationConfig(
            do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0))
    finally:
        reference.generation_config = own
    return out.cpu().numpy()


def left_padded(vocab: int, lengths=PADDED_PROMPTS, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths, left-padded with token 0: (input_ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids, mask = torch.zeros(len(lengths), width, dtype=torch.long), torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(1, vocab, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask


@torch.no_grad()
def generation(sess, reference: nn.Module, np_dtype, new_tokens: int = 20) -> dict:
    """Greedy tokens in ORT vs PyTorch: one prompt, then a left-padded batch (each row also run alone)."""
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, reference.config.vocab_size, (1, 5), generator=g)
    ref = torch_greedy(reference, prompt, torch.ones_like(prompt), new_tokens)
    got = ort_greedy(sess, reference, prompt.numpy(), new_tokens, np_dtype)
    ids, mask = left_padded(reference.config.vocab_size)
    batch_ref = torch_greedy(reference, ids, mask, new_tokens)[:, -new_tokens:]
    batch_got = ort_greedy(sess, reference, ids.numpy(), new_tokens, np_dtype, mask.numpy())[:, -new_tokens:]
    alone = np.concatenate([ort_greedy(sess, reference, ids[r:r + 1, mask[r] == 1].numpy(), new_tokens, np_dtype)
                            [:, -new_tokens:] for r in range(len(ids))])
    rows = [bool(np.array_equal(batch_got[r], batch_ref[r]) and np.array_equal(batch_got[r], alone[r]))
            for r in range(len(ids))]
    return {"new_tokens": new_tokens, "match": bool(np.array_equal(got, ref) and all(rows)),
            "ort": got[0, 5:].tolist(), "torch": ref[0, 5:].tolist(),
            "padded_rows_match": rows, "prompt_lengths": [int(n) for n in mask.sum(1)]}


def latency_ms(sess, model: nn.Module, with_past: bool, np_dtype, batch: int = 1, seq: int = 32,
               runs: int = 10) -> float:
    feed = random_inputs(model, batch, seq)
    feed["attention_mask"][:] = 1
    with_positions(sess, feed)
    if with_past:
        feed.update(empty_past(model, batch, np_dtype))
    sess.run(None, feed)  # warm-up
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        sess.run(None, feed)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def opened(staged: Path, report):
    """onnx.checker on the file, the fused norm nodes ORT's optimiser leaves (into `report`), an ORT session."""
    try:
        check_file(staged)
    except Exception as e:
        raise NormswapError(f"onnx.checker rejected the export: {first_line(e)}") from None
    try:
        report.fused = optimized_norm_nodes(staged)
        return session(staged)
    except Exception as e:
        raise NormswapError(f"onnxruntime cannot load the export: {first_line(e)[:300]}") from None


def check_stamp(sess, report) -> None:
    """The export's fingerprint holds in `sess` (FingerprintFailed where not); the report says it was checked."""
    if onnx_fingerprint.holds(sess, "the exported graph") is None:
        report.fingerprint["checked"] = True


def check_fingerprint(path: str | Path) -> bool:
    """Check the ONNX file `path` against the fingerprint normswap wrote into its metadata, in onnxruntime on the
    CPU: True where it holds (and the digest its model's folder recorded, where it keeps one); False where it
    carries none (a warning says why); FingerprintFailed (a NormswapError) where it does not hold."""
    try:
        sess = session(path)
    except Exception as e:
        raise NormswapError(f"onnxruntime cannot load {path}: {first_line(e)[:300]}") from None
    why = onnx_fingerprint.holds(sess, str(path))
    if why is not None:
        warnings.warn(f"{path}: no fingerprint to check ({why})", stacklevel=2)
    return why is None


def bound(row: dict, fp16: bool, fp32_tol: float, fp16_tol: float) -> float:
    """The largest |ORT - PyTorch| an output may show: its dtype's tolerance relative to the output's largest
    magnitude, absolute below 1 (a trained LM's logits reach 20-30: an absolute fp32 bound refused exports whose
    relative error is 5e-5)."""
    return (fp16_tol if fp16 else fp32_tol) * max(1.0, row["ref_max"])


def validate_export(staged: Path, report, reference: nn.Module, fp16: bool, fp32_tol: float,
                    fp16_tol: float) -> None:
    """Fill `report` with the checks; raise NormswapError on the first one that fails."""
    sess = opened(staged, report)
    dev = next(reference.parameters()).device
    feed = {k: torch.from_numpy(v).to(dev) for k, v in random_inputs(reference, 1, 8).items()}
    check_fused(report, report.norms, norm_calls(reference, {**feed, "use_cache": False})[1])
    np_dtype = np.float16 if fp16 else np.float32
    report.parity = parity(sess, reference, report.output, report.with_past, np_dtype)
    for r in report.parity:
        tol = bound(r, fp16, fp32_tol, fp16_tol)
        report.tolerance = tol if report.tolerance is None else max(report.tolerance, tol)
        if not r["finite"] or r["max_abs"] > tol:
            raise NormswapError(f"ORT output differs from PyTorch at batch {r['batch']}, seq {r['seq']}: "
                                f"max |Δ| {r['max_abs']:.3e} > {tol:.1e}" + ("" if r["finite"] else " (non-finite)"))
    if report.with_past:
        report.generation = generation(sess, reference, np_dtype)
        gen = report.generation
        if not gen["match"] and not fp16:
            bad = [r for r, ok in enumerate(gen["padded_rows_match"]) if not ok]
            raise NormswapError(f"greedy generation differs: ORT {gen['ort']} vs PyTorch {gen['torch']}" if not bad
                                else f"greedy generation of a left-padded batch differs in rows {bad} "
                                     f"(prompt lengths {gen['prompt_lengths']}) between ORT, PyTorch and "
                                     f"each prompt alone")
    check_stamp(sess, report)
    report.latency_ms = latency_ms(sess, reference, report.with_past, np_dtype)
    report.validated = True


def _growths(sess) -> list[tuple[str, str]]:
    """(what, dim) to grow the example along: each dynamic dim of the graph's inputs, one at a time, first seen
    first (the batch); none where a dim is an expression (s0 + 1), which doubling one symbol would not fit."""
    seen: dict[str, str] = {}
    for i in sess.get_inputs():
        for axis, d in enumerate(i.shape):
            if isinstance(d, str) and d not in seen:
                seen[d] = "batch size doubled" if axis == 0 and not seen else f"{i.name} axis {axis} doubled"
    return [(what, d) for d, what in seen.items()] if all(d.isidentifier() for d in seen) else []


def grown(sess, batch: dict, dim: str) -> dict:
    """`batch` with each input axis the graph names `dim` doubled (the tensor, then its mirror image)."""
    shapes = {i.name: i.shape for i in sess.get_inputs()}
    flat = []
    for name, t in wrap.flat_inputs(batch):
        for axis, d in enumerate(shapes.get(name, ())):
            t = torch.cat([t, t.flip(axis)], axis) if d == dim else t
        flat.append(t)
    return wrap.substitute(batch, iter(flat))


def _described(batch: dict, what: str) -> str:
    return f"{what} ({', '.join(n + ' ' + 'x'.join(map(str, t.shape)) for n, t in wrap.flat_inputs(batch))})"


@torch.no_grad()
def module_parity(sess, reference: nn.Module, batch: dict, names: list[str], what: str, np_dtype) -> list[dict]:
    """Per output: max |ORT - PyTorch| and max |PyTorch| on `batch` (integer outputs: max |Δ| too)."""
    graph = {i.name for i in sess.get_inputs()}
    feed = {n: (t.detach().cpu().numpy().astype(np_dtype) if t.is_floating_point() else t.detach().cpu().numpy())
            for n, t in wrap.flat_inputs(batch) if n in graph}
    ref = [t for _, t in tensors(reference(**batch))]
    try:
        got = sess.run(names, feed)
    except Exception as e:
        raise NormswapError(f"onnxruntime cannot run the export on {what}: {first_line(e)[:300]}") from None
    if len(ref) != len(got):
        raise NormswapError(f"the model returns {len(ref)} tensors on {what}, the graph {len(got)}")
    lead = next((t for _, t in wrap.flat_inputs(batch) if t.dim()), None)
    rows = []
    for name, r, g in zip(names, ref, got):
        r = r.detach().double().cpu().numpy()
        diff = np.abs(g.astype(np.float64) - r)
        rows.append({"inputs": what, "output": name, "batch": 1 if lead is None else int(lead.shape[0]),
                     "max_abs": float(diff.max(initial=0.0)), "ref_max": float(np.abs(r).max(initial=0.0)),
                     "finite": bool(np.isfinite(g).all())})
    return rows


class GrownFails(NormswapError):
    """The graph fails on the example grown along a dynamic dim (it holds on the examples): the exporter made
    that dim dynamic, but the model's graph does not hold for other sizes (a cache sized on an earlier call)."""


def _runs(sess, reference: nn.Module, batches: list[dict]):
    """(batch, what) to compare on: each example batch, then the first grown, where PyTorch runs it."""
    yield from ((b, _described(b, f"example batch {i}")) for i, b in enumerate(batches))
    for what, dim in _growths(sess):
        batch = grown(sess, batches[0], dim)
        try:
            with torch.no_grad():
                reference(**batch)
        except Exception:   # the model does not take that size (positions, image size): nothing to compare
            continue
        yield batch, _described(batch, f"example batch 0, {what}")


def validate_module(staged: Path, report, reference: nn.Module, batches: list[dict], names: list[str],
                    fp32_tol: float, fp16_tol: float) -> None:
    """`validate_export` for a module exported on example inputs (`batches`, bound and placed for `reference`,
    the fp32 model); every output within `bound`."""
    sess = opened(staged, report)
    kinds = norm_kinds(reference)   # probed once (a copy of each candidate module called) for both counts
    check_fused(report, *norm_calls(reference, batches[0], kinds), constant_calls(reference, batches[0], kinds))
    np_dtype = np.float16 if report.fp16 else np.float32
    for i, (batch, what) in enumerate(_runs(sess, reference, batches)):
        error = NormswapError if i < len(batches) else GrownFails   # the examples come first
        try:
            rows = module_parity(sess, reference, batch, names, what, np_dtype)
        except NormswapError as e:
            raise error(str(e)) from None
        report.parity += rows
        for r in rows:
            tol = bound(r, report.fp16, fp32_tol, fp16_tol)
            r["tolerance"] = tol
            if not r["finite"] or r["max_abs"] > tol:
                raise error(f"ORT output {r['output']} differs from PyTorch on {what}: max |Δ| "
                            f"{r['max_abs']:.3e} > {tol:.1e}" + ("" if r["finite"] else " (non-finite)"))
    check_stamp(sess, report)
    report.tolerance = fp16_tol if report.fp16 else fp32_tol
    report.validated = True
