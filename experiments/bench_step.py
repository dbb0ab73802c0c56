"""One device's training step against the simplest peer: nanoGPT's model.py beside ours, at the same
shapes, dtype and thread count, in one process, alternating, eager and compiled.

    git clone https://github.com/karpathy/nanoGPT /tmp/nanoGPT       # the user fetches it; none of its code is ours
    python experiments/bench_step.py --nanogpt /tmp/nanoGPT
    python experiments/bench_step.py --nanogpt /tmp/nanoGPT --shape small --dtype fp32
    python experiments/bench_step.py --nanogpt /tmp/nanoGPT --compile both --rounds 5
    python experiments/bench_step.py --nanogpt /tmp/nanoGPT --profile --dtype fp32   # the ops of each step
    python experiments/bench_step.py --nanogpt /tmp/nanoGPT --ops --dtype fp32       # kernels.fused vs bandwidth

The contenders take turns step by step: each round warms every contender up (--warmup steps),
then runs --steps cycles of one timed step of each, so that the machine's drift (this shared CPU's
speed moves by tens of percent within minutes) falls on all of them alike. A contender's ratio to
nanoGPT is the median over cycles of nanoGPT's step time over its own in the same cycle, with a 95%
interval from the rounds' medians (one value per round; no interval from one round):
  nanogpt     its GPT and its configure_optimizers' AdamW on random tokens: forward, loss,
              backward, clip to 1.0, step, zero_grad (its train.py's loop without the data)
  ours        the step train.py runs (train.Loop.run_step's: forward, loss, backward, clip, AdamW
              step, scheduler), one process, on random tokens
  ours+loop   train.py's whole loop, in process (train.train): real data from the corpus, the
              loss and grad norm read back, metrics.jsonl, the heartbeat; step time from
              metrics.jsonl. What a user measures. A whole run per round, so not paired: its
              ratio is to nanoGPT's median over all its steps.
and what differs by design, each timed as its own contender when asked (--variants):
  ours@256    vocab 256 instead of 257 (nanoGPT's vocab is free; byte-level data needs 257)
  ours-rope   rotary positions replaced by none (nanoGPT adds learned positions instead)
and MegaScale's switch that nanoGPT has no counterpart for (--variants fused):
  ours+fused  kernels.fused=true: compiled, the loss in the form inductor fuses into two
              reductions (the elementwise chains inductor fuses either way); eager, the eager
              ops, which dispatch what `ours` does (kernels.fused fuses inside a compiled step)
and, compiled, the step recorded as CUDA graphs (--variants graphs):
  ours+graphs train.compile_mode=reduce-overhead: one graph launch replays the compiled step's
              kernels (CUDA; on a CPU the step compiles as `ours` does)
Throughput is tokens/s (batch * seq / median step time). The CPU model and whether it computes
bf16 natively (AVX512-BF16, AMX) are printed first, with how much longer a bf16 GEMM takes than an
fp32 one: AVX512 without BF16 emulates it at ~4x (timed), AVX2 alone at ~1000x, where the bf16
rows say so rather than take hours. A speed-up holds for that CPU only. --allocator sets the
process's allocator for every contender alike: train.py's by default (on a CPU, glibc keeps freed
blocks, machine.keep_freed_memory), and each contender's page faults a step are printed.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import config  # noqa: E402
import intervals  # noqa: E402
import kernels  # noqa: E402
import machine  # noqa: E402
import optim  # noqa: E402
import parallel  # noqa: E402
from model import GPT, Attention  # noqa: E402

SHAPES = {  # the default ("issue"): nanoGPT's Shakespeare-char config at batch 8; and conf/model/small.yaml
    "issue": dict(n_layers=6, d_model=384, n_heads=6, batch=8, seq=256),
    "small": None,
    # Launch-bound on a CPU: ~1e5 FLOPs an op, so each of the step's ~1,000 ops costs its dispatch
    # (a few microseconds) more than its arithmetic; `--count` prints the two side by side.
    "launch": dict(n_layers=4, d_model=64, n_heads=2, batch=1, seq=32),
    # nanoGPT's own GPT-2 124M configuration (its config/train_gpt2.py: batch 12, block 1024, vocab 50304)
    "gpt2": dict(n_layers=12, d_model=768, n_heads=12, batch=12, seq=1024, vocab=50304),
}
VOCAB = 257  # byte-level data's vocabulary, where a shape names none
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEVICE = torch.device("cpu")  # --device: cuda times the same contenders on a GPU
ALLOCATOR = "allocator: torch's caching allocator"  # --allocator, on a CPU


def shape_of(name: str) -> dict:
    if SHAPES[name] is not None:
        return SHAPES[name]
    m = config.compose([f"model={name}"]).model
    return dict(n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads, batch=8, seq=256)


def our_overrides(shape: dict, dtype: str, vocab: Optional[int] = None, compiled: bool = False) -> list:
    return ["model=tiny", f"model.n_layers={shape['n_layers']}", f"model.d_model={shape['d_model']}",
            f"model.n_heads={shape['n_heads']}", "model.bias=false",
            f"model.vocab_size={vocab or shape.get('vocab', VOCAB)}",
            "data.tokenizer=bytes", f"train.batch_size={shape['batch']}", f"train.seq_len={shape['seq']}",
            f"precision={dtype}", f"train.compile={str(compiled).lower()}", "logging.wandb.mode=disabled",
            "logging.progress=false", "train.eval_interval=0", "checkpoint.interval=0", "logging.interval=100000",
            "hardware.peak_tflops=1", "ft.straggler_interval=0", f"hardware.device={DEVICE.type}"]


# --- The contenders: each a function running n steps and returning their times ---

def nanogpt_stepper(path: Path, shape: dict, dtype: torch.dtype, compiled: bool):
    spec = importlib.util.spec_from_file_location("nanogpt_model", path / "model.py")
    module = importlib.util.module_from_spec(spec)
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        spec.loader.exec_module(module)
        model = module.GPT(module.GPTConfig(block_size=shape["seq"], vocab_size=shape.get("vocab", VOCAB),
                                            n_layer=shape["n_layers"],
                                            n_head=shape["n_heads"], n_embd=shape["d_model"], dropout=0.0, bias=False))
        model.to(DEVICE)
        opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), DEVICE.type)
    if compiled:
        model = torch.compile(model)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, shape.get("vocab", VOCAB), (shape["batch"], shape["seq"]), generator=g).to(DEVICE)
    y = torch.randint(0, shape.get("vocab", VOCAB), (shape["batch"], shape["seq"]), generator=g).to(DEVICE)
    autocast = torch.autocast(DEVICE.type, dtype=dtype, enabled=dtype != torch.float32)

    def step() -> None:
        with _phase("model"), autocast:
            _, loss = model(x, y)
        with _phase("model"):
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    step.modules = [model]
    return step


def our_stepper(shape: dict, dtype: str, compiled: bool, vocab: Optional[int] = None, rope: bool = True,
                extra: tuple = ()):
    vocab = vocab or shape.get("vocab", VOCAB)
    cfg = config.compose(our_overrides(shape, dtype, vocab, compiled) + list(extra))
    device = DEVICE
    layout = parallel.build_layout(cfg.parallel, 0, 1, device)
    with torch.device("meta"):
        model = GPT(cfg.model, cfg.kernels)
    engine = parallel.build(model, layout, cfg.parallel, fused=cfg.kernels.fused, dtype=DTYPES[dtype], device=device,
                            seed=cfg.train.seed)
    if not rope:  # this model's attention unrotated; an instance's patch, so the other contenders keep theirs
        for module in (m for chunk in engine.chunks for m in chunk.modules() if isinstance(m, Attention)):
            module.mix = functools.partial(mix_without_rope, module)
    if compiled:
        import train
        engine.compile(**train.compile_mode_choice(cfg.train.compile_mode, device)[0])
    opt = optim.build_optimizer(engine.named_optimizer_parameters(), cfg.optim, cfg.train.lr, norm_group=engine.norm_group)
    scheduler = optim.build_scheduler(opt, cfg.optim, 10 ** 6)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (shape["batch"], shape["seq"]), generator=g).to(device)
    y = torch.randint(0, vocab, (shape["batch"], shape["seq"]), generator=g).to(device)

    def step() -> None:
        with _phase("model"):
            loss = engine.forward_backward(x, y, DTYPES[dtype])  # as train.Loop.run_step
        grad_norm = engine.finish_gradients(cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf"))
        engine.optimizer_step(opt)
        scheduler.step()
        torch.stack([loss.detach(), grad_norm]).tolist()  # train.py's one host read per step
    step.modules = engine.chunks
    return step


def mix_without_rope(attention: Attention, qkv: torch.Tensor) -> torch.Tensor:
    """model.Attention.mix without the rotation: what RoPE costs (nanoGPT learns position embeddings)."""
    B, T, _ = qkv.shape
    q, k, v = kernels._heads(qkv, attention.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
    return attention.core(q, k, v).transpose(1, 2).reshape(B, T, -1)


def timed(step, n: int, warmup: int) -> list:
    for _ in range(warmup):
        step()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        if DEVICE.type == "cuda":  # nanoGPT's step reads nothing back: wait for its kernels
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def interleaved(steppers: dict, n: int, warmup: int, faults: Optional[dict] = None) -> dict:
    """One round: every stepper warmed up, then n cycles of one timed step of each, in turn. Each
    stepper's minor page faults (the kernel mapping and zeroing fresh pages) go into faults."""
    for step in steppers.values():
        timed(step, 0, warmup)
    times = {name: [] for name in steppers}
    for _ in range(n):
        for name, step in steppers.items():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            times[name] += timed(step, 1, 0)
            if faults is not None:
                faults.setdefault(name, []).append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return times


def paired_ratios(base: list, times: list) -> list:
    """base / times cycle by cycle: > 1 where the contender's step was the shorter."""
    return [b / t for b, t in zip(base, times)]


def our_loop_times(shape: dict, dtype: str, compiled: bool, n: int, warmup: int, allocator: str) -> list:
    """train.py's loop in this process (train.train), its step times from metrics.jsonl."""
    import train
    cfg = config.compose(our_overrides(shape, dtype, None, compiled) + [f"train.max_steps={warmup + n}",
                         f"hardware.keep_freed_memory={str(allocator == 'train').lower()}"])
    with tempfile.TemporaryDirectory() as run_dir, contextlib.redirect_stdout(open(os.devnull, "w")):
        train.train(cfg, Path(run_dir))
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time"] for r in rows[warmup:]]


# --- What a step dispatches, counted: the same on every machine, what a launch-bound GPU pays ---

COUNTING = False  # count_table sets it: the steppers' phase ranges exist only in a profile


def _phase(name: str):
    """A profiler range naming a part of the step (while counting; nothing while timing)."""
    return torch.profiler.record_function(name) if COUNTING else contextlib.nullcontext()


# ATen ops that launch no kernel though the dispatcher sees no alias: allocations, dtype no-ops,
# the host read (counted apart).
NO_KERNEL = {"aten::_unsafe_view", "aten::_reshape_alias", "aten::detach_", "aten::resolve_conj", "aten::resolve_neg",
             "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::lift_fresh",
             "aten::resize_", "aten::set_", "aten::_local_scalar_dense"}


@functools.lru_cache(maxsize=None)
def _kernel_kind(name: str) -> str:
    """"none" for an ATen op that runs no kernel itself (a view, a composite that only calls other
    ops, NO_KERNEL); "own" for one with the device's own kernel; "maybe" for one written once
    over other ops (CompositeExplicitAutograd: copy_ is a kernel, clone and zeros_like only call one)."""
    packet = getattr(torch.ops.aten, name[len("aten::"):], None)
    if name in NO_KERNEL or packet is None:
        return "none"
    overload = getattr(packet, packet.overloads()[0])  # the main one (add: Tensor, linear: default)
    if overload.is_view or overload.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd):
        return "none"
    backend = torch._C.DispatchKey.CUDA if DEVICE.type == "cuda" else torch._C.DispatchKey.CPU
    return "own" if overload.has_kernel_for_dispatch_key(backend) else "maybe"


def _is_kernel(event) -> bool:
    """A compiled graph's kernel, an ATen op with the device's own kernel, or one written over other
    ops that calls no kernel (so a copy counts once, not again as the `to` or `clone` around it)."""
    if "_cpp_fused_" in event.name or event.name.startswith("triton_"):
        return True
    kind = _kernel_kind(event.name) if event.name.startswith("aten::") else "none"
    return kind == "own" or (kind == "maybe" and not any(_is_kernel(c) for c in event.cpu_children))


PHASES = ("forward", "backward", "optimizer")


def _phase_of(event, backward: list, model: list) -> str:
    """Backward: inside one of autograd's node evaluations; forward: in the model's range outside
    them (the forward and the loss); optimizer: the rest of the step (reductions, clipping, the
    update, zeroing, the scheduler, the host read)."""
    t = event.time_range.start
    if any(lo <= t < hi for lo, hi in backward):
        return "backward"
    return "forward" if any(lo <= t < hi for lo, hi in model) else "optimizer"


def dispatch_counts(step) -> dict:
    """One profiled step's counts by phase: kernels (_is_kernel), host reads (.item()), Python
    autograd.Function calls (forward and backward) and the hooks the step fires (module and
    post-accumulate-grad hooks, registered once, each firing once a microbatch here)."""
    from torch.profiler import ProfilerActivity, profile
    global COUNTING
    COUNTING = True
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    finally:
        COUNTING = False
    events = prof.events()
    ranges = lambda pick: [(e.time_range.start, e.time_range.end) for e in events if pick(e.name)]
    backward = ranges(lambda n: n.startswith("autograd::engine::evaluate_function:"))
    model = ranges(lambda n: n == "model")
    python_nodes = {e.name.split(": ")[1] for e in events if e.name.startswith("autograd::engine::evaluate_function:")
                    and not e.name.endswith(tuple("0123456789")) and "AccumulateGrad" not in e.name}
    python_functions = python_nodes | {n[:-len("Backward")] for n in python_nodes}
    counts = {(what, phase): 0 for what in ("kernels", "host reads", "python calls") for phase in PHASES}
    for e in events:
        if _is_kernel(e):
            what = "kernels"
        elif e.name == "aten::_local_scalar_dense":
            what = "host reads"
        elif e.name in python_functions:
            what = "python calls"
        else:
            continue
        counts[what, _phase_of(e, backward, model)] += 1
    hooks = sum(len(getattr(m, kind)) for root in step.modules for m in root.modules()
                for kind in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks"))
    hooks += sum(len(p._post_accumulate_grad_hooks or {}) + len(p._backward_hooks or {})
                 for root in step.modules for p in root.parameters())
    counts["hooks", "backward"] = hooks
    return counts


def python_frames(step) -> int:
    """The Python functions one step calls, every frame counted (ours, torch's, torch.compile's
    wrappers and guards' fallbacks): what a launch-bound step pays in the interpreter beside its
    kernels' dispatch. The calling thread's alone: on a GPU autograd runs the backward on its
    device thread, whose frames this misses, so the figure is a CPU's."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"
    sys.setprofile(count)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


def dispatch_cost_us(reps: int = 20000) -> float:
    """The cost of one eager op that does almost nothing on this device (a 1-element in-place add,
    autograd off): what each kernel costs a launch-bound step at least, beside its arithmetic."""
    x = torch.zeros(1, device=DEVICE)
    with torch.no_grad():
        for _ in range(1000):
            x.add_(1.0)
        start = time.perf_counter()
        for _ in range(reps):
            x.add_(1.0)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e6


def gemm_gflops(n: int = 512, reps: int = 20) -> float:
    """This device's fp32 GEMM rate, the best of reps n x n x n products."""
    a = torch.randn(n, n, device=DEVICE)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        a @ a
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best / 1e9


def count_table(args) -> str:
    """Each contender's step, counted (dispatch_counts), eager and compiled, beside its measured
    step time, the floor its kernels' dispatch alone puts under it, and (in the head) what its
    arithmetic takes at this device's GEMM rate: where the step is far above the latter, it is
    dispatch (and Python) that it spends its time on."""
    from model import flops_per_token
    shape, dtype = shape_of(args.shape), args.dtype.split(",")[0]
    per_op, rate = dispatch_cost_us(), gemm_gflops()
    tokens = shape["batch"] * shape["seq"]
    flops = flops_per_token(config.compose(our_overrides(shape, dtype)).model, shape["seq"]) * tokens
    lines = [f"{machine.cpu_model()} | threads {torch.get_num_threads()} | torch {torch.__version__} | {dtype} | "
             f"shape {args.shape}: {shape} | one eager op's dispatch {per_op:.1f} us (a 1-element add) | "
             f"{flops / 1e6:,.1f} MFLOP a step, {flops / rate / 1e6:.2f} ms at this device's {rate:,.0f} GFLOP/s "
             f"(a 512^3 fp32 GEMM); step times: median of {args.steps} steps in turn\n",
             "| mode | contender | kernels fwd / bwd / opt / all | host reads | autograd Python calls | hooks | "
             "Python frames | step ms (median) | kernels x dispatch ms |", "|---|---|---|---|---|---|---|---|---|"]
    for compiled in {"eager": [False], "compiled": [True], "both": [False, True]}[args.compile]:
        contenders = {"nanogpt": nanogpt_stepper(args.nanogpt, shape, DTYPES[dtype], compiled),
                      "ours": our_stepper(shape, dtype, compiled)}
        if "rope" in args.variants:
            contenders["ours-rope"] = our_stepper(shape, dtype, compiled, rope=False)
        if "fused" in args.variants:
            contenders["ours+fused"] = our_stepper(shape, dtype, compiled, extra=("kernels.fused=true",))
        if "graphs" in args.variants and compiled:
            contenders["ours+graphs"] = our_stepper(shape, dtype, True, extra=("train.compile_mode=reduce-overhead",))
        times = interleaved(contenders, args.steps, args.warmup)
        for name, step in contenders.items():
            c = dispatch_counts(step)
            kernels_by_phase = [c["kernels", p] for p in PHASES]
            total, ms = sum(kernels_by_phase), statistics.median(times[name]) * 1e3
            lines.append(f"| {'compiled' if compiled else 'eager'} | {name} | "
                         f"{' / '.join(map(str, kernels_by_phase))} / **{total}** | "
                         f"{sum(c['host reads', p] for p in PHASES)} | {sum(c['python calls', p] for p in PHASES)} | "
                         f"{c['hooks', 'backward']} | {python_frames(step):,} | {ms:.2f} | {total * per_op / 1e3:.2f} |")
    return "\n".join(lines)


# The ops both models run with the same ATen kernels at the same shapes: the model's arithmetic,
# which no step code can make cheaper (short of other kernels). The rest is each step's own.
SHARED_KERNELS = ("aten::mm", "aten::_scaled_dot_product_flash_attention", "aten::gelu", "aten::native_layer_norm",
                  "aten::embedding_dense_backward", "aten::index_select", "aten::_log_softmax", "aten::nll_loss")


def profile_tables(args, rows: int = 12) -> str:
    """torch.profiler's table by op of each contender's steady steps (eager unless --compile compiled;
    the first --dtype): on a CPU by self CPU time, on CUDA by the kernels' own GPU time, where ours
    spends what nanoGPT does not."""
    from torch.profiler import ProfilerActivity, profile
    shape, out, shared, totals = shape_of(args.shape), [], {}, {}
    dtype, compiled = args.dtype.split(",")[0], args.compile == "compiled"
    cuda = DEVICE.type == "cuda"
    contenders = {"nanogpt": nanogpt_stepper(args.nanogpt, shape, DTYPES[dtype], compiled),
                  "ours": our_stepper(shape, dtype, compiled)}
    if "fused" in args.variants:
        contenders["ours+fused"] = our_stepper(shape, dtype, compiled, extra=("kernels.fused=true",))
    if "rope" in args.variants:
        contenders["ours-rope"] = our_stepper(shape, dtype, compiled, rope=False)
    own = "self_device_time_total" if cuda else "self_cpu_time_total"
    for name, step in contenders.items():
        timed(step, 0, args.warmup)
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            timed(step, args.steps, 0)
        events = prof.key_averages()
        # on CUDA the kernels' own rows (an op's row counts its kernels' time again)
        per_step = sum(getattr(e, own) for e in events
                       if not cuda or e.device_type == torch.autograd.DeviceType.CUDA) / args.steps / 1e3
        shared[name] = sum(getattr(e, own) for e in events if e.key.startswith(SHARED_KERNELS)) / args.steps / 1e3
        totals[name] = per_step
        where = "GPU kernel time" if cuda else "CPU time"
        out.append(f"### {name} ({dtype}, {args.compile if compiled else 'eager'}): {per_step:,.2f} ms of {where} per "
                   f"step, {shared[name]:,.2f} of them in the kernels both models run (matmuls, SDPA, GeLU, LayerNorm, "
                   f"embedding, loss; eager names), by op\n\n" + events.table(sort_by=own, row_limit=rows))
    if shared["nanogpt"]:  # from nanoGPT's profile alone, so that drift between the two blocks stays out of it
        out.append(f"Ceiling: the kernels both models run take {shared['nanogpt']:,.2f} ms of nanoGPT's "
                   f"{totals['nanogpt']:,.2f} ms step; a step that ran only them would be "
                   f"{totals['nanogpt'] / shared['nanogpt']:.2f}x nanoGPT here. Beyond them ours spends "
                   f"{totals['ours'] - shared['ours']:,.2f} ms a step, nanoGPT {totals['nanogpt'] - shared['nanogpt']:,.2f}.")
    return "\n\n".join(out)


# --- kernels.fused at the step's shapes, against the memory-bandwidth bound ---

# The least traffic each op's forward + backward can have, in activations of the op's input size
# (each input read once and each output written once per pass; parameters, the saved mean and
# rstd, and dbias's reduction are a row's worth or less, left out):
#   LN+residual   fwd x, delta -> sum, y (4); bwd dy, dsum, sum -> dx = ddelta (4)
#   bias+GeLU     fwd x -> y (2); bwd dy, x -> dx (3), on the 4h-wide activation
#   LN+GeLU       the two above on the MLP's input, each on its own
#   cross-entropy fwd logits (1); bwd logits -> dlogits (2)
TRAFFIC = {"LN+residual": lambda n, h, rv: 8 * n * h, "bias+GeLU (4h)": lambda n, h, rv: 5 * n * 4 * h,
           "LN+GeLU": lambda n, h, rv: 5 * n * h + 5 * n * 4 * h, "cross-entropy": lambda n, h, rv: 3 * rv,
           # q and k read and written forward; dq, dk, dv read and the projection's gradient written back
           "heads+RoPE": lambda n, h, rv: 10 * n * h}


def stream_GBps(reps: int = 20) -> float:
    """This CPU's memory bandwidth as torch sees it: the best copy of a 256 MiB fp32 buffer (read
    and written), on torch's threads."""
    x = torch.empty(2 ** 26)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        y.copy_(x)
        best = min(best, time.perf_counter() - start)
    return 2 * x.numel() * 4 / best / 1e9


# Where bf16 is emulated, how slowly decides whether it is timed: AVX512 without its BF16 extension
# converts in registers (a GEMM ~4x fp32's time: minutes a table), AVX2 alone ~1000x (hours).
BF16_TIMEABLE_SLOWDOWN = 10


def bf16_timeable() -> bool:
    return machine.native_bf16() or machine.bf16_gemm_slowdown() <= BF16_TIMEABLE_SLOWDOWN


def bf16_note() -> str:
    return (f"this CPU emulates bf16 (no AVX512-BF16 or AMX), a GEMM {machine.bf16_gemm_slowdown():.0f}x fp32's "
            "time: not timed")


def ops_table(args) -> str:
    """kernels.fused=true's ops (experiments/bench_kernels.py's closures) at the step's activation
    shapes, eager and fused, each against bytes moved / measured bandwidth."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_kernels
    shape, dtype = shape_of(args.shape), args.dtype.split(",")[0]
    if dtype == "bf16" and not bf16_timeable():
        return f"bf16: {bf16_note()}; --dtype fp32"
    B, T, h, vocab = shape["batch"], shape["seq"], shape["d_model"], shape.get("vocab", VOCAB)
    ops_args = argparse.Namespace(shape=f"{B},{T},{h}", vocab=vocab, device="cpu", logit_rows=B * T,
                                  head_dim=h // shape["n_heads"])
    element = torch.finfo(DTYPES[dtype]).bits // 8
    gbps = stream_GBps()
    lines = [f"{machine.cpu_model()} | threads {torch.get_num_threads()} | {dtype} | activations [{B}, {T}, {h}] | "
             f"stream bandwidth {gbps:.1f} GB/s (a 256 MiB copy) | median of {args.rounds * args.steps} runs\n",
             "| op | eager ms | fused ms | speed-up | least bytes moved | bound ms | fused / bound | eager / bound |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, make in bench_kernels.fused_ops(ops_args, DTYPES[dtype]).items():
        key = next((k for k in TRAFFIC if name.startswith(k)), None)
        if key is None:  # the lone LayerNorm that fused=true leaves to ATen
            continue
        (eager, _), (fused, _) = bench_kernels.timed_together([make(False), make(True)], args.rounds * args.steps,
                                                             args.warmup, time.perf_counter)
        moved = TRAFFIC[key](B * T, h, B * T * vocab) * element
        bound = moved / (gbps * 1e9)
        lines.append(f"| {name} | {eager * 1e3:.2f} | {fused * 1e3:.2f} | {eager / fused:.2f}x | {moved / 1e6:.1f} MB | "
                     f"{bound * 1e3:.2f} | {fused / bound:.1f}x | {eager / bound:.1f}x |")
    return "\n".join(lines)


# --- Running and the table ---

def bench(args) -> list:
    shape = shape_of(args.shape)
    tokens = shape["batch"] * shape["seq"]
    rows = []
    for dtype in args.dtype.split(","):
        if dtype == "bf16" and DEVICE.type == "cpu" and not bf16_timeable():
            rows.append({"dtype": dtype, "mode": "-", "note": bf16_note()})
            continue
        for compiled in {"eager": [False], "compiled": [True], "both": [False, True]}[args.compile]:
            contenders = {"nanogpt": nanogpt_stepper(args.nanogpt, shape, DTYPES[dtype], compiled),
                          "ours": our_stepper(shape, dtype, compiled)}
            if "vocab" in args.variants:
                contenders["ours@256"] = our_stepper(shape, dtype, compiled, vocab=256)
            if "rope" in args.variants:
                contenders["ours-rope"] = our_stepper(shape, dtype, compiled, rope=False)
            if "fused" in args.variants:
                contenders["ours+fused"] = our_stepper(shape, dtype, compiled, extra=("kernels.fused=true",))
            if "graphs" in args.variants and compiled:
                contenders["ours+graphs"] = our_stepper(shape, dtype, True, extra=("train.compile_mode=reduce-overhead",))
            times = {name: [] for name in [*contenders, *(["ours+loop"] if args.loop else [])]}
            ratios = {name: [] for name in contenders}
            round_ratios = {name: [] for name in contenders}
            faults = {}
            for _ in range(args.rounds):
                block = interleaved(contenders, args.steps, args.warmup, faults)
                for name, t in block.items():
                    times[name] += t
                    ratios[name] += paired_ratios(block["nanogpt"], t)
                    round_ratios[name].append(statistics.median(paired_ratios(block["nanogpt"], t)))
                if args.loop:
                    times["ours+loop"] += our_loop_times(shape, dtype, compiled, args.steps, args.warmup,
                                                         args.allocator)
            base = tokens / statistics.median(times["nanogpt"])
            for name, t in times.items():
                rate = tokens / statistics.median(t)
                paired = name in ratios and args.rounds > 1
                rows.append({"dtype": dtype, "mode": "compiled" if compiled else "eager", "contender": name,
                             "tokens_per_s": rate, "steps": len(t),
                             "vs_nanogpt": statistics.median(ratios[name]) if name in ratios else rate / base,
                             "interval": intervals.half_width(round_ratios[name]) if paired else None,
                             "faults": statistics.median(faults[name]) if name in faults else None,
                             "round_ratios": round_ratios.get(name)})
    return rows


def table(rows: list, args) -> str:
    shape = shape_of(args.shape)
    where = torch.cuda.get_device_name() if DEVICE.type == "cuda" else (
        f"bf16 native: {machine.native_bf16()}, a bf16 GEMM takes {machine.bf16_gemm_slowdown():.1f}x fp32's")
    head = (f"{machine.cpu_model()} | {where} | threads {torch.get_num_threads()} | "
            f"torch {torch.__version__}\nshape {args.shape}: {shape}, vocab {shape.get('vocab', VOCAB)}, no bias; "
            f"median of "
            f"{args.rounds} rounds x {args.steps} steps, contenders in turn step by step; vs nanoGPT: the median "
            f"of paired step-time ratios, ± a 95% interval over the rounds' medians, each round's median after\n"
            f"{ALLOCATOR}, for every contender alike\n")
    lines = ["| dtype | mode | contender | tokens/s | vs nanoGPT | rounds | page faults a step |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "note" in r:
            lines.append(f"| {r['dtype']} | - | {r['note']} | | | | |")
        else:
            spread = f" ± {r['interval']:.2f}" if r.get("interval") is not None else ""
            per_round = ", ".join(f"{x:.2f}" for x in r["round_ratios"]) if r.get("round_ratios") else "unpaired"
            faults = f"{r['faults']:,.0f}" if r.get("faults") is not None else ""
            lines.append(f"| {r['dtype']} | {r['mode']} | {r['contender']} | {r['tokens_per_s']:,.0f} | "
                         f"{r['vs_nanogpt']:.2f}x{spread} | {per_round} | {faults} |")
    return head + "\n" + "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nanogpt", type=Path, required=True, help="a checkout of karpathy/nanoGPT (its model.py)")
    p.add_argument("--shape", choices=tuple(SHAPES), default="issue")
    p.add_argument("--dtype", default="fp32,bf16", help="fp32, bf16 or both (comma-separated)")
    p.add_argument("--compile", choices=("eager", "compiled", "both"), default="both")
    p.add_argument("--variants", default="", help="also time what differs by design (vocab, rope), "
                   "kernels.fused=true (fused) and, compiled, train.compile_mode=reduce-overhead (graphs), "
                   "comma-separated")
    p.add_argument("--no-loop", dest="loop", action="store_false",
                   help="leave out ours+loop (a whole train.py run a round)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, the cores)")
    p.add_argument("--allocator", choices=("train", "default"), default="train", help="for the whole process, so "
                   "for every contender alike: train.py's (on a CPU, glibc keeps freed blocks: "
                   "machine.keep_freed_memory) or glibc's defaults")
    p.add_argument("--ops", action="store_true", help="instead: kernels.fused's ops at the step's shapes, eager and "
                   "fused, each against its memory-bandwidth bound (bytes moved / measured bandwidth)")
    p.add_argument("--count", action="store_true", help="instead: what each step dispatches (kernels, host reads, "
                   "autograd Python calls, hooks, Python frames; forward, backward, optimizer apart), eager and compiled, beside "
                   "its step time (the first --dtype)")
    p.add_argument("--profile", action="store_true", help="instead of timing: torch.profiler's table by op of "
                   "nanoGPT's and our step (the first --dtype; eager unless --compile compiled)")
    args = p.parse_args(argv)
    if not (args.nanogpt / "model.py").is_file():
        print(f"bench_step: --nanogpt {args.nanogpt} has no model.py. Fix: git clone https://github.com/karpathy/nanoGPT "
              f"and give its path", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    global DEVICE, ALLOCATOR
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cpu":
        ALLOCATOR = machine.keep_freed_memory() if args.allocator == "train" else "allocator: glibc's defaults"
    print(count_table(args) if args.count else ops_table(args) if args.ops else
          profile_tables(args) if args.profile else table(bench(args), args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
