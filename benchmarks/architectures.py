"""Exact-conversion coverage over transformers' architectures, as a new user meets them.

    python benchmarks/architectures.py                       # every model type (~25 min on 2 cores)
    python benchmarks/architectures.py --types gpt2,swin,vit # some
    python benchmarks/architectures.py --report out.jsonl    # the summary of an earlier run

Each model type transformers registers is built tiny from its config class's defaults (sizes shrunk where
the config has them, nested configs too), its LayerNorms and means perturbed far from init, and run in its
own process: `normswap.convert(model, method="auto")`, then every output compared, on normswap's own
sample inputs and on other ones (another seed, batch and length), with the original's outputs taken before
the conversion; then saved and reloaded by normswap and by plain transformers (`trust_remote_code`) and
compared again. Outputs the report declares not preserved are left out of the comparison, and counted.

Outcomes: exact (every norm converted), exact+kept (some kept as LayerNorms, the rest exact), WRONG (exact
claimed, an undeclared output differs: the bug that must never happen), naive (auto fell back; the reason
is the exact plan's refusal), no-inputs (normswap cannot build sample inputs, and says why), model-failed
(the tiny model fails on the inputs normswap built: its inputs, or this script's shrinking of the config, are
wrong), error (an exception escaped normswap), and, outside the counts, the types that have no LayerNorm or
cannot be built tiny here.

`--rotate` adds a rotation row per type (`rotation`: one entry per ARMS): after an exact (or exact+kept)
conversion, or on the built model where it has no LayerNorm (its RMSNorms, perturbed off 1, found by what they
compute), `normswap.rotate` three ways, each on its own model (the first on the one converted above, the others
rebuilt from the same seed; where R1 is refused, the others are by the same checks, which run before
their own, and take its refusal, marked `"as": "R1"`), compared with the original's outputs on both input
sets in memory and after
`normswap.save` / `normswap.load`, the outputs the rotation report declares not preserved left out. Outcomes:
rotated (<= TOL everywhere), refused (NotRotatable / NormswapError: its one-line reason), WRONG (rotated, an
output differs), error (an exception escaped normswap).
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOL = 1e-4
ARMS = {"R1": {}, "R1+R2": {"heads": True}, "R1+R2+R4": {"heads": True, "online": True}}   # rotate's keywords
SIZES = {   # attribute -> tiny value, set where the config has it (an int there)
    32: ("hidden_size", "d_model", "n_embd", "embed_dim", "word_embed_proj_dim", "projection_dim",
         "cross_attention_hidden_size", "d_embed", "image_size", "out_hidden_size",
         "projection_hidden_size", "projector_hidden_size", "output_dim", "mit_hidden_size", "pooler_output_size"),
    2: ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers", "n_layers",
        "num_decoder_layers", "num_encoder_layers", "speech_encoder_layers", "t2u_encoder_layers",
        "t2u_decoder_layers", "num_key_value_heads", "num_experts_per_tok"),
    4: ("window_size", "num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
        "decoder_attention_heads", "attention_heads", "decoder_num_attention_heads", "n_routed_experts",
        "num_experts", "num_local_experts"),
    64: ("intermediate_size", "moe_intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner",
         "d_ff", "dff", "max_target_positions", "max_source_positions", "mit_intermediate_size"),
    128: ("max_position_embeddings", "n_positions", "n_ctx"),   # text and the image tokens spliced into it
    8: ("head_dim", "d_kv", "rotary_dim", "patch_size", "kv_channels", "qk_rope_head_dim", "qk_nope_head_dim",
        "v_head_dim"),
    16: ("kv_lora_rank", "q_lora_rank", "index_head_dim"),   # an indexer head: 8 rotary channels and 8 more
    1: ("n_group", "topk_group"),   # expert groups: the 4 experts left in one
    0: ("insert_layer_id",),   # MiniCPM-V's merger: after the first of 2 layers
    99: ("vocab_size",),
}


def tiny_dict(config, every_kind: bool = True) -> dict:
    """config's dict with sizes shrunk (see SIZES), per-stage lists cut to 2 stages, nested configs too;
    per-layer lists cut to the first layers and (`every_kind`) the first layer of each kind."""
    d = config.to_dict()
    out = {}
    for value, keys in SIZES.items():
        for k in keys:
            if isinstance(d.get(k), int) and not isinstance(d.get(k), bool) and d[k] > value:
                out[k] = value
    for heads, kv in (("num_attention_heads", "num_key_value_heads"), ("n_head", "n_head_kv")):
        if heads in out and d.get(kv) == d[heads]:   # multi-head latent attention needs as many kv heads
            out[kv] = out[heads]
    if "qk_head_dim" in d and "qk_rope_head_dim" in out:
        out["qk_head_dim"] = out["qk_rope_head_dim"] + out.get("qk_nope_head_dim", d.get("qk_nope_head_dim", 0))
    if isinstance(d.get("coordinate_size"), int) and isinstance(d.get("shape_size"), int):   # LayoutLMv3's boxes:
        out["coordinate_size"], out["shape_size"] = 4, 8   # 4 coordinates and 2 sides as wide as 32 channels
    if isinstance(d.get("depths"), list):   # hierarchical vision (Swin...): 2 stages of 1 block
        out["depths"] = [1, 1]
        if isinstance(d.get("num_heads"), list):
            out["num_heads"] = [2, 4]
        out["embed_dim"] = 16
    layers = out.get("num_hidden_layers")
    if layers and isinstance(d.get("global_attn_indexes"), list):   # SAM's global-attention layers: the last
        out["global_attn_indexes"] = [layers - 1]
    if layers and isinstance(d.get("out_features"), list):   # a backbone: the stages its 2 layers have
        out["out_features"], out["out_indices"] = ["stage1", "stage2"], [1, 2]
    if "sliding_window" in d and d["sliding_window"] is None and any("sliding_" in k for k in d):
        out["sliding_window"] = 8   # Step 3.7's default config sizes its sliding layers but not their window
    per_layer = {k: v for k, v in d.items()
                 if isinstance(v, list) and layers and len(v) == d.get("num_hidden_layers") and len(v) > layers}
    if per_layer:   # the first layers and the first of each kind (layer_types...): a cache needs attention
        keep = set(range(layers)) | {v.index(x) for v in per_layer.values() for x in v
                                     if isinstance(x, str) and every_kind}
        out["num_hidden_layers"] = len(keep)
        out.update({k: [v[i] for i in sorted(keep)] for k, v in per_layer.items()})
    for k, v in d.items():
        if isinstance(v, dict) and "model_type" in v:
            sub = getattr(config, k, None)
            if hasattr(sub, "to_dict"):
                out[k] = {**v, **tiny_dict(sub, every_kind)}
    if isinstance(d.get("mm_tokens_per_image"), int):   # Gemma 3 pools the 4x4 patches of a 32-pixel image
        out["mm_tokens_per_image"] = 4
    for k in ("vision_feature_layers", "vision_feature_layer"):   # VipLLaVA: as many layers, all within 2
        if isinstance(d.get(k), (list, tuple)):
            out[k] = [max(-2, min(i, 1)) for i in d[k]]
    if isinstance(d.get("projector_patch_to_query_dict"), dict):   # Aria: queries for a 32-pixel image's 16 patches
        out["projector_patch_to_query_dict"] = {16: 4}
    if isinstance(d.get("image_grid_pinpoints"), list):   # LLaVA-NeXT: tiles of the 32-pixel images
        out["image_grid_pinpoints"] = [[32, 64], [64, 32], [64, 64]]
    rope, mrope = d.get("rope_parameters"), uses_mrope(config)   # reads the modelling file: once
    if isinstance(rope, dict) and mrope:
        head = out.get("head_dim") or out.get("hidden_size", 32) // out.get("num_attention_heads", 4)
        pairs = int(head * rope.get("partial_rotary_factor", d.get("partial_rotary_factor") or 1)) // 2
        # (time, rows, columns) of the rotary pairs: [2, 1, 1] of 4, [1, 0, 1] of GLM-4V-MoE's 2
        out["rope_parameters"] = {**rope, "mrope_section": [pairs // 2, pairs // 4, pairs - pairs // 2 - pairs // 4]}
    if mrope:   # the Omni thinkers' default configs lack the vision start id their code reads
        d.setdefault("vision_start_token_id", 10 ** 9)
    vocab = out.get("vocab_size", d.get("vocab_size"))
    if vocab is None and isinstance(out.get("text_config"), dict):   # a multimodal model's text vocabulary
        vocab = out["text_config"].get("vocab_size")
    if isinstance(vocab, int):   # special ids inside the shrunk vocabulary, distinct from each other
        free = vocab - 1
        for k, v in d.items():   # BLIP-2's (Voxtral's) default config leaves its image (audio) token unset
            unset = v is None and k.startswith(("image_", "video_", "audio_"))
            if k.endswith(("_token_id", "_token_index")) and (isinstance(v, int) and v >= vocab or unset):
                out[k], free = free, free - 1
    return out


def renamed_by(model) -> list[str]:
    """The keys of transformers 5's checkpoint renaming table whose renaming loading `model` applies, the root's
    first: per sub-model (itself included), its class name's entry, else its model_type's, as
    `conversion_mapping.get_model_conversion_mapping` picks them (none in transformers 4)."""
    from transformers import PreTrainedModel
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return []
    seen: dict[str, list[str]] = collections.defaultdict(list)   # key -> the sub-models that claimed it
    keys = []
    for name, sub in model.named_modules():
        if not isinstance(sub, PreTrainedModel):
            continue
        cls, kind = type(sub).__name__, sub.config.model_type
        claimed = {k for k in (cls, kind) if any(s == "" or name.startswith(s + ".") for s in seen[k])}
        if cls in claimed:   # by an ancestor
            continue
        via_class = get_checkpoint_conversion_mapping(cls) is not None
        if not via_class and (not kind or kind in claimed or get_checkpoint_conversion_mapping(kind) is None):
            continue
        keys.append(cls if via_class else kind)
        seen[cls].append(name)
        if not via_class:
            seen[kind].append(name)
    return list(dict.fromkeys(keys))


def uses_mrope(config) -> bool:
    """Whether the config's modelling code splits its rotary pairs by (time, rows, columns): Qwen-VL's M-RoPE."""
    import importlib
    try:
        code = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
        return "mrope_section" in Path(code.__file__).read_text()
    except (ImportError, OSError):
        return False


def build(model_type: str):
    """(tiny model, its class name) or raise. `model_type` may be a transformers model class's name instead."""
    import torch
    import transformers as tf
    from transformers.models.auto import modeling_auto as auto

    tables = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
              "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "MODEL_MAPPING_NAMES",
              *sorted(n for n in dir(auto) if n.endswith("_MAPPING_NAMES")))
    if isinstance(getattr(tf, model_type, None), type) and issubclass(getattr(tf, model_type), tf.PreTrainedModel):
        tables = ({model_type: model_type},)   # a class name (transformers' renaming tables name some)
    for table in tables:
        name = (getattr(auto, table) if isinstance(table, str) else table).get(model_type)
        name = name[0] if isinstance(name, (list, tuple)) else name
        if name and isinstance(getattr(tf, name, None), type) and issubclass(getattr(tf, name), tf.PreTrainedModel):
            cls = getattr(tf, name)
            config_cls = cls.config_class or tf.CONFIG_MAPPING[model_type]   # MusicGen's decoder: its own
            try:
                config = config_cls(**tiny_dict(config_cls()))
                torch.manual_seed(0)
                return cls(config).eval(), name
            except Exception:   # a layer count the kinds do not fit (Dory's input, loop and output layers)
                config = config_cls(**tiny_dict(config_cls(), every_kind=False))
                torch.manual_seed(0)
                return cls(config).eval(), name
    raise LookupError("no model class")


def perturb_gains(model, seed: int = 2) -> None:
    """Move every parameter-only leaf module's 1-D parameters (norm gains: Gemma's 1+w and T5's alike) off init."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            params = list(m.parameters(recurse=False))
            if params and not list(m.children()) and all(p.dim() == 1 for p in params):
                for p in params:
                    p.add_(0.5 * torch.randn(p.shape, generator=g))


def judged(models: dict, refs: list, skip: dict, errors: dict, row: dict) -> str | None:
    """Each of `models` (where -> load) compared with `refs` but the outputs `skip` names: its worst relative error,
    or its exception, into `errors` (and `row`'s errors, worst, why); "WRONG" where an output differs, "error" where
    one failed, None where all are within TOL."""
    from normswap.parity import compare_to
    for where, load in models.items():
        try:
            m = load().eval()
            worst = max((compare_to(r, m, skip=skip) for r in refs), key=lambda p: p.max_rel)
            errors[where] = worst.max_rel if worst.max_rel == worst.max_rel else float("inf")
            if not worst.max_rel <= TOL:
                row.setdefault("worst", f"{where}: {worst.worst} rel {worst.max_rel:.2e}")
        except Exception as e:
            errors[where] = f"{type(e).__name__}: {str(e)[:200]}"
    row["errors"] = errors
    bad = [k for k, v in errors.items() if not isinstance(v, float) or not v <= TOL]
    if any(isinstance(errors.get(k), float) for k in bad):
        return "WRONG"
    if bad:
        row["why"] = "; ".join(f"{k}: {errors[k]}" for k in bad)
        return "error"
    return None


def rotated(fresh, arm: str, refs: list, skip: dict) -> dict:
    """One rotation arm (ARMS) on the model `fresh()` returns: its outcome, reason or errors (module docstring)."""
    import normswap
    from normswap.errors import NormswapError

    try:
        model = fresh()
        report = normswap.rotate(model, **ARMS[arm])
    except NormswapError as e:   # NotRotatable is one
        return {"outcome": "refused", "kind": type(e).__name__, "why": str(e).splitlines()[0]}
    except Exception as e:
        return {"outcome": "error", "why": f"{type(e).__name__}: {str(e)[:300]}"}
    skip = {**skip, **report.not_preserved}
    errors, row = {}, {"not_preserved": sorted(report.not_preserved), "streams": len(report.streams)}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = str(Path(tmp) / "out")
        models = {"memory": lambda: model, "reload": lambda: normswap.load(tmp)[0]}
        try:
            normswap.save(model, tmp)
        except Exception as e:
            errors["save"] = f"{type(e).__name__}: {str(e)[:200]}"
            del models["reload"]
        row["outcome"] = judged(models, refs, skip, errors, row) or "rotated"
    return row


def rotation_arms(model_type: str, model, refs: list, skip: dict, converting: bool) -> dict:
    """Every arm of ARMS: the first on `model`, the others on the model rebuilt (and converted) from the same seed."""
    import normswap
    sys.path.insert(0, str(HERE.parent / "tests"))
    from helpers.exact_models import perturb

    def rebuilt():
        m = perturb(build(model_type)[0])
        if converting:
            normswap.convert(m, method="auto")
        else:
            perturb_gains(m)
        return m

    out = {}
    for i, arm in enumerate(ARMS):
        if i and out["R1"]["outcome"] == "refused":   # R1's refusals come before any check of R2's or R4's own
            out[arm] = {**out["R1"], "as": "R1"}
            continue
        out[arm] = rotated((lambda: model) if i == 0 else rebuilt, arm, refs, skip)
        print(f"# {model_type} {arm}: {out[arm]['outcome']}", file=sys.stderr, flush=True)
    return out


def one(model_type: str, rotate: bool = False) -> dict:
    """Everything measured for one model type (see the module docstring); `rotate`: the rotation arms too."""
    import transformers as tf
    from torch import nn

    import normswap
    from normswap.errors import NormswapError
    from normswap.models.inputs import sample_inputs
    from normswap.parity import reference_outputs
    from normswap.surgery.walk import Skip
    sys.path.insert(0, str(HERE.parent / "tests"))
    from helpers.exact_models import perturb

    row: dict = {"type": model_type}
    try:
        model, row["class"] = build(model_type)
    except Exception as e:
        return {**row, "outcome": "unbuilt", "why": f"{type(e).__name__}: {str(e)[:200]}"}
    row["renamed"] = renamed_by(model)
    norms = [n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    row["layernorms"] = len(norms)
    if sum(p.numel() for p in model.parameters()) > 30e6:
        return {**row, "outcome": "unbuilt", "why": "big"}
    if not norms and not rotate:
        return {**row, "outcome": "no-layernorm", "why": ""}
    perturb(model)
    if not norms:
        perturb_gains(model)   # the RMSNorms' gains, which `perturb` leaves at init
    try:
        refs = [reference_outputs(model, sample_inputs(model)),
                reference_outputs(model, sample_inputs(model, batch=3, seq=11, seed=1))]
    except NormswapError as e:   # no inputs built, or the model fails on them (or on this tiny config of it)
        return {**row, "outcome": "model-failed" if "fails on the sample inputs" in str(e) else "no-inputs",
                "why": str(e)}
    except Exception as e:
        return {**row, "outcome": "model-failed", "why": f"{type(e).__name__}: {str(e)[:200]}"}
    if not norms:   # rotated as built: its RMSNorms (if any) are found by what they compute
        return {**row, "outcome": "no-layernorm", "why": "",
                "rotation": rotation_arms(model_type, model, refs, {}, converting=False)}
    try:
        report = normswap.convert(model, method="auto")
    except NormswapError as e:
        return {**row, "outcome": "refused", "why": str(e)}
    except Exception as e:
        return {**row, "outcome": "error", "why": f"{type(e).__name__}: {str(e)[:300]}"}
    if report.method != "exact":
        why = next((w for w in report.warnings if "exact" in w), "; ".join(report.warnings))
        return {**row, "outcome": "naive", "why": why}
    kept = [s.name for s in report.skipped if s.cause is Skip.KEPT]
    row.update(converted=report.num_converted, kept=kept, declared=sorted(report.unverified))
    errors = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = {"memory": lambda: model}
        try:
            tmp = str(Path(tmp) / "out")
            normswap.save_pretrained(model, tmp)
            models["normswap reload"] = lambda: normswap.from_pretrained(tmp)
            auto = json.loads((Path(tmp) / "config.json").read_text()).get("auto_map", {})
            head = next((k for k in auto if k != "AutoConfig"), None)
            if head:
                models["transformers reload"] = lambda: getattr(tf, head).from_pretrained(tmp, trust_remote_code=True)
        except Exception as e:
            errors["save"] = f"{type(e).__name__}: {str(e)[:200]}"
        row["outcome"] = judged(models, refs, report.unverified, errors, row) or ("exact+kept" if kept else "exact")
    if rotate and row["outcome"] in ("exact", "exact+kept"):
        row["rotation"] = rotation_arms(model_type, model, refs, dict(report.unverified), converting=True)
    return row


def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
    return sorted(MODEL_MAPPING_NAMES)


def isolated(script: str | Path, types: list[str], jobs: int, timeout: int, extra: tuple[str, ...] = ()):
    """Each type's row, in order: `script --one TYPE *extra` run in its own process (`jobs` at a time, one thread
    each), the last JSON line it prints; a timeout or a crash is a row of its own."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

    def child(t: str) -> dict:
        cmd = [sys.executable, str(script), "--one", t, *extra]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"type": t, "outcome": "timeout", "why": f"over {timeout} s"}
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            tail = (p.stderr.strip().splitlines() or [""])[-1]
            return {"type": t, "outcome": "crash", "why": tail[:300]}
        return json.loads(lines[-1])

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        yield from pool.map(child, types)


def run_all(types: list[str], out: Path, jobs: int, timeout: int, rotate: bool = False) -> None:
    with out.open("w") as f:
        for row in isolated(__file__, types, jobs, timeout, ("--rotate",) if rotate else ()):
            f.write(json.dumps(row) + "\n")
            f.flush()
            arms = " ".join(f"{a}:{r['outcome']}" for a, r in row.get("rotation", {}).items())
            print(f"{row['type']:<32} {row['outcome']:<11} {arms} {row.get('why', row.get('worst', ''))[:150]}",
                  flush=True)


def report(path: Path) -> None:
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    counts = collections.Counter(r["outcome"] for r in rows)
    print(f"{len(rows)} model types, {path}")
    for outcome in ("exact", "exact+kept", "WRONG", "naive", "refused", "no-inputs", "model-failed", "error",
                    "crash", "timeout", "no-layernorm", "unbuilt"):
        print(f"  {outcome:<13} {counts.get(outcome, 0)}")
    post = sum(r["outcome"] == "naive" and "post-LN" in r.get("why", "") for r in rows)
    tried = sum(counts.get(k, 0) for k in ("exact", "exact+kept", "WRONG", "naive", "refused", "no-inputs",
                                           "model-failed", "error", "crash", "timeout"))
    good = counts.get("exact", 0) + counts.get("exact+kept", 0)
    print(f"with LayerNorms and built: {tried}; refused as post-LN: {post}; exact of the rest: {good}/{tried - post}"
          f" ({100 * good / max(1, tried - post):.0f}%)")
    for r in rows:
        if r["outcome"] in ("WRONG", "naive", "refused", "no-inputs", "model-failed", "error", "crash", "timeout") \
                and "post-LN" not in r.get("why", ""):
            print(f"  {r['outcome']:<9} {r['type']:<28} {(r.get('why') or r.get('worst', ''))[:160]}")
    if any("rotation" in r for r in rows):
        rotation_report(rows)


def reason(why: str) -> str:
    """A refusal's reason with the parts and sizes it names left out, to group by."""
    why = re.sub(r"\b\w+(\.\w+)*(?='s\b)|\b\w+(\.\w+)+\b", "<name>", why)   # module names
    why = re.sub(r"\((\w+)\)", "(<class>)", why)
    return re.sub(r"(?<=\s)'[^']*'", "'…'", re.sub(r"\d+", "N", why))[:200]   # quoted operations


def rotation_report(rows: list[dict]) -> None:
    """Counts per rotation arm; every refusal's reason grouped; every WRONG and error in full."""
    tried = [r for r in rows if "rotation" in r]
    print(f"\nrotation: {len(tried)} types tried (exactly converted, or without a LayerNorm)")
    outcomes = ("rotated", "refused", "WRONG", "error")
    print(f"  {'arm':<10} {'model':<24} " + " ".join(f"{o:>8}" for o in outcomes))
    for arm in ARMS:
        for source, rs in (("as built (no LayerNorm)", [r for r in tried if r["outcome"] == "no-layernorm"]),
                           ("converted exactly", [r for r in tried if r["outcome"] != "no-layernorm"])):
            counts = collections.Counter(r["rotation"][arm]["outcome"] for r in rs)
            print(f"  {arm:<10} {source:<24} " + " ".join(f"{counts.get(o, 0):>8}" for o in outcomes))
    for arm in ARMS:
        groups = collections.defaultdict(list)
        for r in tried:
            got = r["rotation"].get(arm, {})
            if got.get("outcome") == "refused":
                groups[reason(got["why"])].append(r["type"])
        print(f"\n{arm} refusals, by reason:")
        for why, types in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            print(f"  {len(types):>4}  {why}: {', '.join(types)}")
    for r in tried:
        for arm, got in r["rotation"].items():
            if got["outcome"] in ("WRONG", "error"):
                print(f"\n{got['outcome']} {r['type']} {arm}: {json.dumps(got)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", help="comma-separated model types (default: all)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=Path("architectures.jsonl"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=180)
    ap.add_argument("--report", type=Path, help="summarise an earlier run's JSONL")
    ap.add_argument("--rotate", action="store_true", help="the rotation arms too (see the docstring)")
    a = ap.parse_args()
    if a.one:
        import warnings
        warnings.filterwarnings("ignore")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        print(json.dumps(one(a.one, a.rotate), default=str))
        return
    if a.report:
        report(a.report)
        return
    start = time.time()
    run_all(a.types.split(",") if a.types else model_types(), a.out, a.jobs, a.timeout, a.rotate)
    print(f"{time.time() - start:.0f} s")
    report(a.out)


if __name__ == "__main__":
    main()
