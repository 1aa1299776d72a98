"""CPU, PyTorch: normswap's fused RMSNorm op and converted models against their LayerNorm originals.

    python benchmarks/cpu.py                   # op, graph, models, share, heal (~4 h on 2 cores, estimated)
    python benchmarks/cpu.py --quick           # fewer shapes and repeats (~10 min, estimated)
    python benchmarks/cpu.py --only op --dtypes fp32 --threads 1

op: nn.LayerNorm (the bar), normswap RMSNorm (module, eager), F.rms_norm, and torch.compile of the
RMSNorm and LayerNorm modules, forward (no grad) and backward (autograd.grad of a retained graph: the
backward kernels only), at decode-to-prefill rows x widths 256-8192, fp32 and bf16.
models: the demo model and a random GPT-2-small (LayerNorm biases perturbed so the exact conversion
has work to do), original vs `normswap.convert(model, method="exact")`, eager and torch.compile'd
(dynamic shapes), 1 and 2 threads: greedy generation tokens/s and prefill time.
share: the time inside the modules where the two models differ (norms, the conversion's fixes), eager.
heal: one training step (forward + backward of the LM loss) original vs converted, eager and compiled.

Every table is measured interleaved: candidates alternate within each repeat (two flip their order every
repeat, more take a new random order), so drift and neighbours' load hit all alike. Op tables report the fastest
repeat (each ~20 ms of calls; interference only ever adds time). Model tables time each model as an arm of
identical copies (--instances, 3): two identical models differ here by up to ~5% (their tensors at other
addresses), a fixed effect of each copy that no number of repeats averages out, and an arm's mean over
its copies does. They report the median of the per-repeat ratios converted / original (each repeat
times every copy back to back) with its 95% confidence interval, and beside it the A/A control
copy / original: an arm of more copies of the original, timed in the same repeats. Each timed model call
follows one untimed call of the same model (warm, as in a user's loop, whatever ran before it). One-thread runs
are timed in the benchmark thread's CPU time (time.thread_time), so a shared machine's other jobs do not
count while they hold the core; two-thread runs need wall time (and a quiet machine). Ratios < 1: normswap faster.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import functools
import itertools
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    ap.add_argument("--only", choices=("op", "graph", "models", "share", "heal"), action="append",
                    help="run only these parts")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--threads", default="1,2", help="thread counts for the model tables (op: the first)")
    ap.add_argument("--reps", type=int, default=0, help="repeats per op candidate (default 15, quick 7)")
    ap.add_argument("--model-reps", type=int, default=0,
                    help="repeats per model arm, models and heal (default 15, quick 7)")
    ap.add_argument("--models", choices=("demo", "gpt2"), action="append",
                    help="models, share and heal: only these models (default both)")
    ap.add_argument("--instances", type=int, default=3,
                    help="identical copies of each model per arm, models and heal (default 3)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile candidates")
    return ap.parse_args(argv)


def device_line() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return (f"{model}, {os.cpu_count()} cores, ATen {torch.backends.cpu.get_cpu_capability()}; torch "
            f"{torch.__version__}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
            f"load average {os.getloadavg()[0]:.2f}")


def clock():
    """The benchmark thread's CPU time when torch runs one thread (a busy neighbour then costs us cache,
    not the time it holds the core), else wall time."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def clock_name() -> str:
    return "thread CPU time" if torch.get_num_threads() == 1 else "wall time"


def interleaved(cands: dict, reps: int, budget: float = 0.02, stat=statistics.median) -> dict[str, float]:
    """Seconds per call of each candidate (`stat` over repeats); each repeat times ~`budget` s of calls."""
    return {name: stat(v) for name, v in repeats(cands, reps, budget).items()}


def paired_ratio(arms: dict, reps: int, budget: float, now=None) -> tuple[dict[str, tuple[float, float, float]], dict]:
    """Each arm / "original": `arms` maps an arm to its instances' calls (the same work on identical copies of
    one model). Every instance is timed in every repeat, the arms' instances interleaved; an arm's time in a
    repeat is its instances' mean. The ratio is the median of the per-repeat ratios (drift common to all
    cancels) with its 95% confidence interval (order statistics of the ratios: distribution-free); also each
    arm's median seconds per call. `now`: the clock, as in `repeats`."""
    n = len(arms["original"])
    cands = {(arm, i): fns[i] for i in range(n) for arm, fns in arms.items()}
    times = repeats(cands, reps, budget / n, warm=True, now=now)
    per_arm = {arm: [statistics.fmean(times[arm, i][r] for i in range(n)) for r in range(reps)] for arm in arms}
    out = {}
    for name, t in per_arm.items():
        if name == "original":
            continue
        ratios = sorted(c / o for c, o in zip(t, per_arm["original"]))
        half = 0.98 * reps ** 0.5  # the binomial(n, 1/2) ranks around the median that cover it with 95%
        lo, hi = max(0, int(reps / 2 - half)), min(reps - 1, int(reps / 2 + half + 0.5))
        out[name] = (statistics.median(ratios), ratios[lo], ratios[hi])
    return out, {k: statistics.median(v) for k, v in per_arm.items()}


def with_control(pair: dict, instances: int) -> dict[str, list]:
    """Each model of `pair` as an arm of `instances` deep copies of it, plus the arm "copy": as many more copies
    of the original, the A/A control. Two identical models differ here by up to ~5% (their tensors at other
    addresses), a fixed effect of each copy that repeats do not average out; an arm's mean over copies does,
    and copy / original shows what is left. The copies are made round-robin over the arms (and `flat` lists
    them so): where the allocator puts a copy depends on what it did before, so no arm gets all the early or
    late places. (Alone this did not remove the first arm's 1-2% lead after other work; the order `repeats`
    runs them in did, RESULTS.md 2026-11-28 14:26.)"""
    arms = {k: [] for k in (*pair, "copy")}
    for _ in range(instances):
        for k in arms:
            arms[k].append(copy.deepcopy(pair["original" if k == "copy" else k]))
    return arms


def flat(arms: dict) -> list:
    """The arms' models round-robin (warm-up and compilation in that order too)."""
    return [m for group in zip(*arms.values()) for m in group]


def ratio_cell(r: tuple) -> str:
    return f"**{r[0]:.3f}** ({r[1]:.3f}-{r[2]:.3f})"


def repeats(cands: dict, reps: int, budget: float, warm: bool = False, now=None) -> dict[str, list[float]]:
    """Seconds per call of each candidate in each repeat, candidates alternating: two flip their order each
    repeat; more run in a new random order each repeat (seeded), never one right after itself (it would
    find its data in cache where the others do not). `warm`: one untimed call before each timed batch. A
    fixed cycle (rotating its start) gave each candidate the same predecessor in every repeat; the original
    arm's ran the same compiled code (likely found warm), and that arm measured 1-2% faster than its own
    copies (RESULTS.md, 2026-11-28 14:26). `now`: the clock (default `clock()`; benchmarks/gpu.py passes wall
    time, its calls ending in a device synchronize)."""
    now = now or clock()
    calls = {}
    for name, fn in cands.items():
        fn()
        t = now()
        fn()
        calls[name] = max(1, int(budget / max(now() - t, 1e-6)))
    times = {name: [] for name in cands}
    order, rng, last = list(cands), random.Random(0), None
    for i in range(reps):
        if len(order) > 2:
            seq = rng.sample(order, len(order))
            while seq[0] == last:
                seq = rng.sample(order, len(order))
        else:
            seq = order if i % 2 == 0 else order[::-1]
        last = seq[-1]
        for name in seq:
            fn, n = cands[name], calls[name]
            if warm:
                fn()
            t = now()
            for _ in range(n):
                fn()
            times[name].append((now() - t) / n)
    return times


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    sys.stdout.flush()


def us(t: float) -> str:
    return f"{t * 1e6:.1f}" if t < 1e-3 else f"{t * 1e6:.0f}"


# ---- the op ----------------------------------------------------------------------------------------
def op_shapes(quick: bool) -> list[tuple[int, int]]:
    rows = [1, 8, 128, 1024] if not quick else [1, 128, 1024]
    widths = [256, 768, 2048, 4096, 8192] if not quick else [256, 768, 4096]
    return [(r, d) for d in widths for r in rows]


def bench_op(args, dtype_name: str, reps: int) -> None:
    from normswap import RMSNorm
    dtype = DTYPES[dtype_name]
    compile_ = not args.no_compile
    fwd_rows, bwd_rows = [], []
    worst = {"fwd": 0.0, "bwd": 0.0}
    for n, d in op_shapes(args.quick):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, d, generator=g).to(dtype)
        dy = torch.randn(n, d, generator=g).to(dtype)
        ln = nn.LayerNorm(d, dtype=dtype)
        rms = RMSNorm(d, eps=1e-5, dtype=dtype)
        w = rms.weight
        cands = {"LN": lambda: ln(x), "ours": lambda: rms(x), "F.rms_norm": lambda: F.rms_norm(x, (d,), w, 1e-5)}
        if compile_:
            rms_c, ln_c = torch.compile(rms, dynamic=False), torch.compile(ln, dynamic=False)
            cands |= {"compiled RMSNorm": lambda: rms_c(x), "compiled LN": lambda: ln_c(x)}
        with torch.no_grad():
            t = interleaved(cands, reps, stat=min)
        worst["fwd"] = max(worst["fwd"], t["ours"] / t["LN"])
        fwd_rows.append([f"{n} x {d}"] + [us(v) for v in t.values()] + [f"**{t['ours'] / t['LN']:.2f}**"]
                        + ([f"{t['compiled RMSNorm'] / t['compiled LN']:.2f}"] if compile_ else []))

        xg = x.detach().requires_grad_()
        outs = {"LN": (ln(xg), [xg, ln.weight, ln.bias]), "ours": (rms(xg), [xg, rms.weight]),
                "F.rms_norm": (F.rms_norm(xg, (d,), w, 1e-5), [xg, w])}
        if compile_:
            outs |= {"compiled RMSNorm": (rms_c(xg), [xg, rms.weight]),
                     "compiled LN": (ln_c(xg), [xg, ln.weight, ln.bias])}

        def grad_of(y, inputs):
            return lambda: torch.autograd.grad(y, inputs, dy, retain_graph=True)
        t = interleaved({k: grad_of(*v) for k, v in outs.items()}, reps, stat=min)
        worst["bwd"] = max(worst["bwd"], t["ours"] / t["LN"])
        bwd_rows.append([f"{n} x {d}"] + [us(v) for v in t.values()] + [f"**{t['ours'] / t['LN']:.2f}**"]
                        + ([f"{t['compiled RMSNorm'] / t['compiled LN']:.2f}"] if compile_ else []))
    names = ["nn.LayerNorm", "normswap RMSNorm", "F.rms_norm"] + (
        ["compiled RMSNorm", "compiled LayerNorm"] if compile_ else [])
    header = ["rows x width"] + [f"{c} us" for c in names] + ["ours / LN"] + (
        ["compiled: RMS / LN"] if compile_ else [])
    table(f"Norm op, forward (no grad), {dtype_name}, {torch.get_num_threads()} thread(s), {clock_name()}, "
          "fastest repeat", header, fwd_rows)
    table(f"Norm op, backward only (autograd.grad of a retained graph), {dtype_name}, "
          f"{torch.get_num_threads()} thread(s), {clock_name()}, fastest repeat", header, bwd_rows)
    print(f"\nworst ours / nn.LayerNorm ({dtype_name}): forward {worst['fwd']:.2f} (target <= 0.90), "
          f"backward {worst['bwd']:.2f} (target <= 1.00)")


class Several(nn.Module):
    """k norms of one input in one forward: compiled, one graph holds k independent norms (reading one
    input keeps the working set of the graph that of one norm's)."""

    def __init__(self, make, k: int):
        super().__init__()
        self.norms = nn.ModuleList(make() for _ in range(k))

    def forward(self, x):
        return [norm(x) for norm in self.norms]


def bench_graph(args, dtype_name: str, reps: int, k: int = 9) -> None:
    """The norm's cost inside a compiled graph, without the per-call overhead a compiled call adds (guards,
    the wrapper): a graph of k norms minus a graph of 1, divided by k - 1, for RMSNorm and nn.LayerNorm."""
    from normswap import RMSNorm
    dtype = DTYPES[dtype_name]
    rows = []
    for n, d in [(r, d) for r, d in op_shapes(args.quick) if r >= 8]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, d, generator=g).to(dtype)
        dys = [torch.randn(n, d, generator=g).to(dtype) for _ in range(k)]
        makes = {"LN": lambda: nn.LayerNorm(d, dtype=dtype), "RMS": lambda: RMSNorm(d, eps=1e-5, dtype=dtype)}
        mods = {(name, j): Several(make, j) for name, make in makes.items() for j in (1, k)}
        for m in mods.values():   # trained-looking gains and biases
            for p in m.parameters():
                p.data.uniform_(0.5, 1.5)
        compiled = {key: torch.compile(m, dynamic=False) for key, m in mods.items()}
        with torch.no_grad():
            fwd = interleaved({key: (lambda c=c: c(x)) for key, c in compiled.items()}, reps, stat=min)
        grads = {}
        for key, c in compiled.items():
            j = key[1]
            xg = x.detach().requires_grad_()
            inputs, outs = [xg, *mods[key].parameters()], c(xg)
            grads[key] = (lambda o=outs, i=inputs, j=j: torch.autograd.grad(o, i, dys[:j], retain_graph=True))
        bwd = interleaved(grads, reps, stat=min)
        row = [f"{n} x {d}"]
        for t in (fwd, bwd):
            per = {name: (t[(name, k)] - t[(name, 1)]) / (k - 1) for name in makes}
            row += [us(per["LN"]), us(per["RMS"]), f"**{per['RMS'] / per['LN']:.2f}**",
                    us(t[("LN", 1)]), f"{t[('RMS', 1)] / t[('LN', 1)]:.2f}"]
        rows.append(row)
        print("  ", " | ".join(row), flush=True)
    cols = ["LN us", "RMS us", "RMS / LN", "one compiled LN call us", "one call: RMS / LN"]
    table(f"Compiled norms inside a graph ({k} norms minus 1, per norm), {dtype_name}, "
          f"{torch.get_num_threads()} thread(s), {clock_name()}, fastest repeat; forward (no grad), then backward",
          ["rows x width"] + [f"fwd {c}" for c in cols] + [f"bwd {c}" for c in cols], rows)


# ---- models ----------------------------------------------------------------------------------------
def build_models(quick: bool, which=None):
    """[(name, original, converted, prefill length)]: the demo model and a random GPT-2-small, or those in `which`."""
    import transformers

    import normswap
    transformers.logging.set_verbosity_error()
    out = []
    which = which or ("demo", "gpt2")
    if "demo" in which:
        demo, *_ = normswap.load_model("normswap-demo")
        out.append(("normswap-demo (4x256)", demo.float().eval(), 128))
    if "gpt2" in which:
        cfg = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
        out.append(("random GPT-2-small (12x768)", random_gpt2(cfg), 128 if quick else 512))
    return [(name, model, exact_conversion(model), seq) for name, model, seq in out]


def random_gpt2(cfg) -> nn.Module:
    """A GPT2LMHeadModel of `cfg` with random weights (seed 0), in eval mode, its LayerNorms trained-looking
    (gains around 1, real biases) so that the exact conversion has biases to fold."""
    import transformers
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0.0, 0.5)
    return model


def exact_conversion(model: nn.Module) -> nn.Module:
    """A deep copy of `model`, made before converting, converted by `normswap.convert(method="exact")`, in eval
    mode; `model` stays as it is."""
    import normswap
    conv = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.convert(conv, method="exact")
    return conv.eval()


def generated_tokens(args) -> int:
    return 16 if args.quick else 32


def workloads(model: nn.Module, seq: int, new_tokens: int) -> dict:
    """The two timed runs, each a function of a model: greedy generation of `new_tokens` after a fixed
    16-token prompt, and a prefill of `seq` tokens (batch 1; the same token ids for every model)."""
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(1))
    prefill = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(2))
    return {"generate": lambda m: m.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                             do_sample=False, pad_token_id=0),
            "prefill": lambda m: m(prefill)}


def bench_models(args, reps: int) -> None:
    models = build_models(args.quick, args.models)
    new_tokens = generated_tokens(args)
    modes = ["eager"] + ([] if args.no_compile else ["compiled"])
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for name, orig, conv, seq in models:
            runs = workloads(orig, seq, new_tokens)
            for mode in modes:
                arms = with_control({"original": orig, "converted": conv}, args.instances)   # copies only
                models_ = flat(arms)
                if mode == "compiled":
                    for m in models_:
                        m.forward = torch.compile(m.forward, dynamic=True)

                with torch.no_grad():
                    for m in models_:  # compile (or warm) both lengths first
                        for fn in runs.values():
                            fn(m)
                    (gen, gen_s), (pre, pre_s) = (
                        paired_ratio({k: [functools.partial(fn, m) for m in ms] for k, ms in arms.items()}, reps,
                                     budget=0.3)
                        for fn in runs.values())
                del arms, models_
                tok = {k: new_tokens / v for k, v in gen_s.items()}
                rows.append([name, mode, str(threads), f"{tok['original']:.1f}", f"{tok['converted']:.1f}",
                             ratio_cell(gen["converted"]), ratio_cell(gen["copy"]),
                             f"{pre_s['original'] * 1e3:.1f}", f"{pre_s['converted'] * 1e3:.1f}",
                             ratio_cell(pre["converted"]), ratio_cell(pre["copy"])])
                print("  ", " | ".join(rows[-1]), flush=True)
    table(f"Models, original (LayerNorm) vs exact-converted (RMSNorm): greedy generation of {new_tokens} "
          f"tokens after a 16-token prompt, and prefill (batch 1); {reps} repeats of {args.instances} copies of "
          "each model, ratio: median of the per-repeat ratios of the copies' means (95% CI); 1 thread: thread "
          "CPU time, 2 threads: wall time",
          ["model", "mode", "threads", "orig tok/s", "conv tok/s", "generate: conv / orig",
           "generate A/A: copy / orig", "orig prefill ms", "conv prefill ms", "prefill: conv / orig",
           "prefill A/A: copy / orig"], rows)


class PartTimer:
    """Thread CPU time spent inside the named modules of `model` (their forward, where a conversion's output and
    input fixes run: the interval holds them)."""

    def __init__(self, model: nn.Module, names: list[str]):
        self.total, self.start, self.handles = 0.0, 0.0, []
        for name in names:
            m = model.get_submodule(name)
            self.handles += [m.register_forward_pre_hook(self.begin, prepend=True), m.register_forward_hook(self.end)]

    def begin(self, module, args):
        self.start = time.thread_time()

    def end(self, module, args, out):
        self.total += time.thread_time() - self.start

    def remove(self):
        for h in self.handles:
            h.remove()


def differing(orig: nn.Module, conv: nn.Module) -> dict[str, list[str]]:
    """The modules where an exact conversion differs from its original, in three groups: "norms" (the norms
    alone), "fixed" (the modules that carry an output or input fix, such as a tied embedding centred at lookup
    or a norm with its bias kept after it) and "biased" (layers given a bias: an LM head given the final norm's,
    whose matmul takes it in, so its own time is mostly the same matmul's, in two copies of the weight).
    Everything else computes the same ops on the same shapes, so the two models' difference in time is these
    modules'."""
    from normswap import RMSNorm

    def added_bias(name, m):
        return getattr(m, "bias", None) is not None and getattr(orig.get_submodule(name), "bias", None) is None

    def fixed(m):
        return hasattr(m, "normswap_centre") or getattr(m, "normswap_centre_input", False)
    mods = dict(conv.named_modules())
    return {"norms": [n for n, m in mods.items() if isinstance(m, RMSNorm) and not fixed(m)],
            "fixed": [n for n, m in mods.items() if fixed(m)],
            "biased": [n for n, m in mods.items() if not fixed(m) and added_bias(n, m)]}


def norm_share(models, new_tokens: int, reps: int) -> None:
    """The model-level difference, measured where it is made (eager, 1 thread): time inside the modules that
    differ (`differing`: LayerNorms in the original, RMSNorms and the conversion's fixes in the converted
    model), summed over each run, against the run's whole time. A whole model's time swings by more than
    the norms' share of it between runs here, the parts' times do not; the rest of the two models is the
    same computation, so the converted model's time is the original's plus the parts' difference. Split in
    two: the norms alone, and the modules carrying the conversion's fixes (timed in the original too, where
    they are plain modules: a fix's cost is the difference)."""
    torch.set_num_threads(1)
    rows = []
    for name, orig, conv, seq in models:
        runs = workloads(orig, seq, new_tokens)
        groups = differing(orig, conv)
        pair = {"original": orig, "converted": conv}
        timers = {(k, g): PartTimer(m, names) for k, m in pair.items() for g, names in groups.items()}
        for run, fn in runs.items():
            inside = {key: [] for key in timers}   # each group's seconds in each call

            def timed(key, fn=fn, inside=inside):
                def call():
                    for g in groups:
                        timers[key, g].total = 0.0
                    fn(pair[key])
                    for g in groups:
                        inside[key, g].append(timers[key, g].total)
                return call
            with torch.no_grad():   # budget 0: one call per repeat; the first two calls warm up
                whole = repeats({k: timed(k) for k in pair}, reps, budget=0.0)
            med = {key: statistics.median(v[-reps:]) for key, v in inside.items()}
            o_whole = statistics.median(whole["original"])
            o, c = (sum(med[k, g] for g in ("norms", "fixed")) for k in pair)
            ms = lambda t: f"{t * 1e3:+.2f}"  # noqa: E731
            diff = {g: med["converted", g] - med["original", g] for g in groups}
            rows.append([name, run, f"{len(groups['norms'])} + {len(groups['fixed'])}", f"{o * 1e3:.2f}",
                         f"{c * 1e3:.2f}", f"{c / o:.2f}", ms(diff["norms"]), ms(diff["fixed"]),
                         f"{o_whole * 1e3:.1f}", f"{100 * o / o_whole:.2f}%", f"**{1 + (c - o) / o_whole:.4f}**",
                         f"{len(groups['biased'])}: {ms(diff['biased'])}" if groups["biased"] else "-"])
            print("  ", " | ".join(rows[-1]), flush=True)
        for timer in timers.values():
            timer.remove()
    table(f"Where the model-level difference is made (eager, 1 thread, thread CPU time, median of {reps} "
          "interleaved repeats): time inside the modules that differ (norms; modules carrying the conversion's "
          "fixes), what each group adds (converted - original), and the converted / original ratio they imply "
          "(the rest is the same computation); layers given a bias apart (`differing`: their time is their matmul's, "
          "which two copies of a weight take at different speeds)",
          ["model", "run", "norms + fixed modules", "orig parts ms", "conv parts ms", "parts: conv / orig",
           "norms: conv - orig ms", "fixed modules: conv - orig ms", "orig whole ms", "parts' share of orig",
           "implied conv / orig", "layers given a bias: conv - orig ms"], rows)


NORM_KERNEL_MARKS = ("native_layer_norm", "rsqrt")   # in Inductor's kernel names: LayerNorm's op; our decomposition's


def kernel_times(fn) -> tuple[float, float, float]:
    """One call of `fn` under the profiler: seconds in Inductor's generated kernels that contain a norm (the
    conversion's fixes fuse into them), in all its generated kernels, and in the whole call."""
    from torch.profiler import ProfilerActivity, profile
    now = clock()
    t = now()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    whole = now() - t
    norm = gen = 0.0
    for e in prof.key_averages():
        if "cpp_fused" in e.key:
            gen += e.self_cpu_time_total * 1e-6
            norm += e.self_cpu_time_total * 1e-6 if any(k in e.key for k in NORM_KERNEL_MARKS) else 0.0
    return norm, gen, whole


def compiled_share(models, new_tokens: int, reps: int) -> None:
    """The model-level difference under torch.compile, measured where it is made (1 thread): Inductor fuses
    the norms and the conversion's fixes into its own kernels, so the parts are those kernels (profiled:
    `cpp.enable_kernel_profile`), in the kernels that contain a norm and in all generated kernels (the rest,
    matmuls and attention, are the same extern calls on the same shapes)."""
    import torch._inductor.config as inductor_config
    torch.set_num_threads(1)
    # Dynamo reuses a graph compiled earlier in this process (the models part's) for any module of the same
    # structure, parameters being inputs: reset, so these models compile anew with the profiled kernels.
    torch._dynamo.reset()
    rows = []
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        for name, orig, conv, seq in models:
            runs = workloads(orig, seq, new_tokens)
            pair = {"original": copy.deepcopy(orig), "converted": copy.deepcopy(conv)}
            for m in pair.values():
                m.forward = torch.compile(m.forward, dynamic=True)
            for run, fn in runs.items():
                got = {k: [] for k in pair}
                with torch.no_grad():
                    for m in pair.values():   # compile, warm
                        fn(m), fn(m)
                    for i in range(reps):
                        for k in (list(pair) if i % 2 == 0 else list(pair)[::-1]):
                            got[k].append(kernel_times(lambda k=k: fn(pair[k])))
                med = {k: [statistics.median(v[j] for v in got[k]) for j in range(3)] for k in pair}
                (on, og, ow), (cn, cg, _) = med["original"], med["converted"]
                rows.append([name, run, f"{on * 1e3:.2f}", f"{cn * 1e3:.2f}", f"{cn / on:.2f}", f"{og * 1e3:.2f}",
                             f"{cg * 1e3:.2f}", f"{cg / og:.3f}", f"{ow * 1e3:.1f}",
                             f"**{1 + (cn - on) / ow:.4f}**", f"**{1 + (cg - og) / ow:.4f}**"])
                print("  ", " | ".join(rows[-1]), flush=True)
    table(f"Where the model-level difference is made, compiled (1 thread, median of {reps} interleaved profiled "
          "calls): Inductor's kernels that contain a norm (and the fixes fused into them), all its generated "
          "kernels, and the converted / original ratio each implies (the rest is the same extern calls)",
          ["model", "run", "orig norm kernels ms", "conv norm kernels ms", "norm kernels: conv / orig",
           "orig generated ms", "conv generated ms", "generated: conv / orig", "orig whole ms (profiled)",
           "implied by norm kernels", "implied by generated kernels"], rows)


# ---- heal step -------------------------------------------------------------------------------------
def bench_heal(args, reps: int) -> None:
    models = build_models(args.quick, args.models)
    modes = ["eager"] + ([] if args.no_compile else ["compiled"])
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for (name, orig, conv, _), mode in itertools.product(models, modes):
            batch, length = (8, 128) if "demo" in name else (2, 128 if args.quick else 256)
            ids = torch.randint(0, orig.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(3))
            arms = with_control({"original": orig, "converted": conv}, args.instances)
            models_ = flat(arms)
            for m in models_:
                m.train()
                for mod in m.modules():
                    if isinstance(mod, nn.Dropout):
                        mod.p = 0.0  # same work in both; dropout masks are not the question
                if mode == "compiled":
                    m.forward = torch.compile(m.forward)

            def step(m):
                def run():
                    m.zero_grad(set_to_none=True)
                    m(ids, labels=ids).loss.backward()
                return run
            for m in models_:   # compile (or warm) first
                step(m)()
            r, secs = paired_ratio({k: [step(m) for m in ms] for k, ms in arms.items()}, reps, budget=0.5)
            del arms, models_
            rows.append([name, mode, f"{batch} x {length}", str(threads), f"{secs['original'] * 1e3:.0f}",
                         f"{secs['converted'] * 1e3:.0f}", ratio_cell(r["converted"]), ratio_cell(r["copy"])])
            print("  ", " | ".join(rows[-1]), flush=True)
    table(f"Heal step (forward + backward of the LM loss), original vs exact-converted; {reps} repeats of "
          f"{args.instances} copies of each model, ratio: median of the per-repeat ratios of the copies' means "
          "(95% CI); 1 thread: thread CPU time, 2 threads: wall time",
          ["model", "mode", "batch x tokens", "threads", "original ms", "converted ms", "conv / orig",
           "A/A: copy / orig"], rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    from normswap.ops import cpu
    if cpu.extension() is None:
        print("the C++ CPU kernel is unavailable here (see the warning): nothing to measure", file=sys.stderr)
        return 1
    reps = args.reps or (7 if args.quick else 15)
    model_reps = args.model_reps or (7 if args.quick else 15)
    # One graph per op shape, and per model object for the shared HF forward code: never fall back to eager.
    torch._dynamo.config.recompile_limit = 512
    parts = args.only or ["op", "graph", "models", "share", "heal"]
    print(f"Device: {device_line()}")
    if "op" in parts:
        torch.set_num_threads(int(args.threads.split(",")[0]))
        for name in args.dtypes.split(","):
            bench_op(args, name, reps)
    if "graph" in parts and not args.no_compile:
        torch.set_num_threads(int(args.threads.split(",")[0]))
        for name in args.dtypes.split(","):
            bench_graph(args, name, reps)
    if "models" in parts:
        bench_models(args, model_reps)
    if "share" in parts:
        models = build_models(args.quick, args.models)
        norm_share(models, generated_tokens(args), model_reps)
        if not args.no_compile:
            compiled_share(models, generated_tokens(args), model_reps)
    if "heal" in parts:
        bench_heal(args, model_reps)
    print(f"\nDone: load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
