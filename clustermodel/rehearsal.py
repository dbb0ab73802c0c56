"""Rehearse a job of any size on this machine: chosen ranks of the real world, one process each,
through the real code (build_layout and the mesh, parallel.build, the pipeline schedule, ZeRO's
buckets, every overlap switch, recompute, the optimizer step, a checkpoint's layout) for a few
steps, on the meta device and torch's "fake" process-group backend: every shape, collective,
FLOP and byte the rank would have, none of its arithmetic.

    python train.py experiment=megascale_ablation scale=cluster ablation.step=8 rehearse.ranks=[0,255]

Each rank writes rehearsal.json (rehearse.out, default the run dir):
- every collective and send/receive in program order (op, mesh dimension, peer, bytes, dtype,
  device, call site), with the waits: what nccl_rules.py replays;
- FLOPs by op class (GEMM, attention, elementwise), per step and per microbatch, and on each
  event the work since the one before (ledgers.Segment), the workload replay.py prices;
- peak memory split into weights, gradients, optimizer state, activations and communication
  buffers, and the moment of the peak;
- the pipeline's order of chunk forwards and backwards; the checkpoint's bytes.
With rehearse.nccl_rules (on by default) it also enforces NCCL's rules: every collective's tensor
on the compute device (meta stands in for CUDA: a CPU tensor there is named with its call site),
no host read of a device tensor beyond the step's one, no host-to-device copy that waits for the
host inside a step (host_syncs.py), and, across the rehearsed ranks and the pipeline plan of the
whole layout, FIFO matching and no deadlock (nccl_rules.check).

torch's pieces are used where they fit: the fake backend (FakeStore, a process group whose
collectives do nothing), the meta device, FlopCounterMode's FLOP formulas. What they lack is
written here: point-to-point on meta (the fake backend has no meta device) and the recording
itself; and in ledgers.py, the work between events and a memory ledger by category (torch's
MemTracker refuses modules called more than once per step, which is every pipeline chunk).
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from clustermodel import rank_costs
from clustermodel.ledgers import FlopLedger, MemoryLedger, categories, cuda_attention, cuda_rms_norm
from clustermodel.recorder import OBJECTS, Recorder, op_of
from clustermodel.schema import rehearsed_world

HERE = str(Path(__file__).resolve().parents[1])  # the repository


# --- One rank's rehearsal ---

class _NoData:
    """The loader's place in a checkpoint (the rehearsal reads no data)."""

    def state_dict(self) -> dict:
        return {}


def rehearse_rank(cfg, rank: int, world: int, out_dir: Path) -> dict:
    """Runs rank `rank` of a `world`-rank job for cfg.rehearse.steps steps on the meta device and
    the fake backend; writes and returns its record. A rank that crashes still writes one: the
    error and where it was raised, beside what was recorded up to it."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import parallel
    started = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        layout = parallel.build_layout(cfg.parallel, rank, world, torch.device("cpu"))
        recorder = Recorder(layout, torch.device("meta"), fake=True, nccl_rules=cfg.rehearse.nccl_rules)
        run = _Run(cfg, layout, recorder)
        try:
            with recorder, _saved_as_compiled(cfg, layout):
                run.steps()
        except Exception as err:  # noqa: BLE001 - reported in the record, where the parent reads it
            frame = traceback.extract_tb(err.__traceback__)[-1]
            run.crash = f"{type(err).__name__}: {str(err).splitlines()[0]} ({Path(frame.filename).name}:{frame.lineno})"
        record = run.record(rank, world, time.perf_counter() - started)
    finally:
        dist.destroy_process_group()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))
    return record


@contextlib.contextmanager
def _saved_as_compiled(cfg, layout):
    """A job that torch.compiles (the default on CUDA) runs its TP blocks traced by dynamo, where
    TPGroup.regather_saved is a no-op: their gathered inputs are saved whole. The rehearsal runs
    eagerly, so for such a job it turns the hooks off too (the layout's TP group keeps gathered
    inputs whole), and the ledger counts those copies (beside the shards the group still
    remembers for a re-gather: an upper bound)."""
    import machine
    if not machine.compiles(cfg):
        yield
        return
    layout.tp_group.keep_gathered_whole = True
    try:
        yield
    finally:
        layout.tp_group.keep_gathered_whole = False


class _Run:
    """One rank's rehearsal: the real code's build and steps under the recorder and the ledgers."""

    def __init__(self, cfg, layout, recorder):
        self.cfg, self.layout, self.recorder = cfg, layout, recorder
        self.dtype = torch.bfloat16 if cfg.precision in ("bf16", "auto") else torch.float32
        self.flops, self.ledger = FlopLedger(), None
        recorder.take_work = self.flops.segment.take
        self.first_step, self.saved, self.crash = [], 0, None

    def steps(self) -> None:
        import checkpoint
        import model as gpt
        import optim
        import parallel
        from parallelisms import pipeline
        cfg, layout, recorder, device = self.cfg, self.layout, self.recorder, torch.device("meta")
        with torch.device("meta"):
            model = gpt.GPT(cfg.model, cfg.kernels)
        engine = parallel.build(model, layout, cfg.parallel, recompute=cfg.train.recompute, fused=cfg.kernels.fused,
                                dtype=self.dtype, recompute_layers=cfg.train.recompute_layers, device=device, seed=cfg.train.seed)
        del model
        self.flops.count_accumulation_into(engine.zero)
        optimizer = optim.build_optimizer(engine.named_optimizer_parameters(), cfg.optim, cfg.train.lr,
                                          norm_group=engine.norm_group, clock=layout.clock)
        ledger = self.ledger = MemoryLedger(device, categories(engine, optimizer, recorder))
        for t in list(engine.zero.params) + [b.params for b in engine.zero.buckets] + \
                [b.master for b in engine.zero.buckets if b.master is not None]:
            ledger.track(t)
        _fused_adamw_in_place(optimizer, ledger, cfg)  # before the scheduler, which wraps optimizer.step
        scheduler = optim.build_scheduler(optimizer, cfg.optim, cfg.train.max_steps)
        tokens = torch.zeros((cfg.train.batch_size // layout.dp, cfg.train.seq_len), dtype=torch.long, device=device)
        max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
        schedule = _label_pipeline(engine, ledger, pipeline)
        original_core = gpt.Attention.core
        gpt.Attention.core = _attention_context(original_core, self.flops)
        try:
            with cuda_attention(self.flops), cuda_rms_norm():
                for step in range(1, cfg.rehearse.steps + 1):
                    recorder.step, ledger.where = step, f"step {step}"
                    with ledger, self.flops:
                        loss = engine.forward_backward(tokens, tokens, self.dtype)  # as train.Loop.run_step
                        norm = engine.finish_gradients(max_norm)
                        engine.optimizer_step(optimizer)
                        scheduler.step()
                        parallel.agree(loss, False, layout, norm)
                    with recorder.named_read():
                        pass
                    if step == 1:
                        self.first_step = list(schedule)
                recorder.step, ledger.where = "eval", "evaluation"
                with ledger, torch.no_grad():  # one held-out batch, as train.evaluate runs it
                    parallel.agree(engine.forward_backward(tokens, tokens, self.dtype, backward=False), False, layout)
                with recorder.named_read():
                    pass
                ledger.where = "checkpoint"
                with ledger:
                    state = checkpoint.training_state(step, engine, optimizer, scheduler, _NoData(), {})
                    self.saved = checkpoint_bytes(state, layout.rank)
        finally:
            gpt.Attention.core = original_core

    def record(self, rank: int, world: int, seconds: float) -> dict:
        import machine
        cfg, layout, ledger, flops = self.cfg, self.layout, self.ledger, self.flops.flops
        steps, split = cfg.rehearse.steps, dict(ledger.peak_split) if ledger else {}
        largest = split.pop("largest_activations", [])
        peak = ledger.peak if ledger else 0
        capacity = int(capacity_gib(cfg) * 2**30)
        return {
            "rank": rank, "world": world, "coordinates": layout.coordinates(),
            "layout": {"dp": layout.dp, "pp": layout.pp, "tp": layout.tp, "vpp": cfg.parallel.vpp,
                       "microbatches": cfg.parallel.microbatches, "zero_stage": cfg.parallel.zero_stage},
            "model": cfg.model.name, "steps": steps, "dtype": str(self.dtype).removeprefix("torch."),
            "compiled": machine.compiles(cfg),
            "flops": {"per_step": {k: v // steps for k, v in flops.items()},
                      "per_microbatch": {k: v // (steps * cfg.parallel.microbatches) for k, v in flops.items()}},
            "grad_accumulation_bytes": {"per_step": self.flops.accumulation_bytes // steps},
            "memory": {"peak_bytes": peak, "at": ledger.peak_at if ledger else "", **{f"{k}_bytes": v for k, v in split.items()},
                       "largest_activations": largest, "capacity_bytes": capacity, "fits": peak <= capacity,
                       "dominant": max(split, key=split.get) if split else None},
            "checkpoint_bytes": self.saved, "schedule": self.first_step, "crash": self.crash,
            "comm": self.recorder.events, "violations": self.recorder.violations, "seconds": seconds,
            "rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "costs": rank_costs.costs(rank, world, self.recorder.events, cfg.ft, layout),  # communicators, sockets, fs calls
        }


def capacity_gib(cfg) -> float:
    """rehearse.capacity_gib, else machine.tensor_memory_gib of the hardware, else 80."""
    import machine
    if cfg.rehearse.capacity_gib is not None:
        return cfg.rehearse.capacity_gib
    usable = machine.tensor_memory_gib(cfg.hardware)
    return 80.0 if usable is None else usable


def _fused_adamw_in_place(optimizer, ledger, cfg) -> None:
    """On a GPU AdamW is torch's fused kernel: its state and nothing else. Its meta stand-in here
    (foreach, as fused has no meta kernel) allocates temporaries the GPU never holds, so the
    ledger does not count them; the state it creates is counted. (LAMB is foreach on GPUs too:
    its temporaries are real and stay counted.)"""
    if cfg.optim.name != "adamw":
        return
    import types
    step = optimizer.step

    def counted_state(self, *args, **kwargs):
        where, ledger.where, ledger.paused = ledger.where, f"{ledger.where.split(':')[0]}: optimizer", True
        try:
            return step(*args, **kwargs)
        finally:
            ledger.paused = False
            for state in optimizer.state.values():
                for value in state.values():
                    ledger.track(value)
            ledger.where = where
    optimizer.step = types.MethodType(counted_state, optimizer)  # bound: the lr scheduler wraps it


def _attention_context(core, flops):
    def counted(self, q, k, v):
        flops.in_attention += 1
        try:
            return core(self, q, k, v)
        finally:
            flops.in_attention -= 1
    return counted


def _label_pipeline(engine, ledger, pipeline) -> list:
    """Names the memory ledger's moments after the pipeline's actions, and returns the list
    the actions are appended to (the schedule this rank ran)."""
    done = []
    if engine.pipeline is None:
        return done

    @contextlib.contextmanager
    def labelled(backward: bool, action=None):  # a hook around each action (ParallelModel.around_compute)
        kind, mb, c = action
        done.append(f"{kind}{mb}.{c}")
        ledger.where = f"{ledger.where.split(':')[0]}: {'forward' if kind == 'F' else 'backward'} of microbatch {mb}, chunk {c}"
        yield
    engine.around_compute.append(labelled)
    return done


def checkpoint_bytes(state: dict, rank: int) -> int:
    """What this rank's share of a checkpoint save writes: DCP's local plan, no data written."""
    import checkpoint
    planner = checkpoint._SavePlanner()
    planner.set_up_planner(state, is_coordinator=rank == 0)
    plan = planner.create_local_plan()
    total = 0
    for item in plan.items:
        if item.tensor_data is not None:
            sizes = item.tensor_data.chunk.sizes
            total += sizes.numel() * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()
        else:
            blob = state[item.index.fqn]
            total += len(blob.getvalue()) if hasattr(blob, "getvalue") else 0
    return total


# --- The parent: one process per rank, then the checks across ranks and the table ---

def precheck(jobs: list, out: Path) -> Optional[str]:
    """Rehearses rank 0 of each (overrides, config, world) for one step, in this process; the first
    job that cannot be built, breaks NCCL's rules or does not fit, in one line, or None."""
    import copy
    for overrides, cfg, world in jobs:
        cfg = copy.deepcopy(cfg)
        cfg.rehearse.steps = 1
        rec = rehearse_rank(cfg, 0, world, out)
        problems = ([f"crashed: {rec['crash']}"] if rec.get("crash") else []) + rec["violations"]
        if cfg.rehearse.nccl_rules and not problems:
            problems = cross_check([rec], cfg)
        if not problems and not rec["memory"]["fits"]:
            m = rec["memory"]
            problems = [f"rank 0 needs {m['peak_bytes'] / 2**30:.3g} GiB at its peak, mostly {m['dominant']} "
                        f"({m[m['dominant'] + '_bytes'] / 2**30:.3g} GiB), over the {capacity_gib(cfg):g} GiB "
                        f"its tensors may use (rehearse.capacity_gib, or hardware.memory_gib less memory_headroom_gib)"]
        if problems:
            return f"job {' '.join(overrides)}: {problems[0]}"
    return None


# --- Rehearsed figures, remembered for dry_run and the performance model ---

def cache_key(cfg, world: int) -> str:
    """What decides a rank's memory: the model, layout, kernels, shapes, optimizer, precision, compiling."""
    import dataclasses
    import hashlib
    import machine
    # asdict, not OmegaConf.structured: the same dict, 80x faster (0.05 s a call, and the
    # performance model asks once per layout it prices)
    whole = dataclasses.asdict(cfg)
    key = {k: whole[k] for k in ("model", "parallel", "kernels")}
    key.update(train={k: whole["train"][k] for k in ("batch_size", "seq_len", "recompute")},
               optim=whole["optim"]["name"], precision=whole["precision"], world=world,
               compiled=machine.compiles(cfg))
    if cfg.train.recompute_layers != -1:  # (absent at its default: the keys remembered before it still match)
        key["train"]["recompute_layers"] = cfg.train.recompute_layers
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def _memory_cache(cfg, world: int) -> Path:
    import machine
    return machine.cache_dir() / "rehearsal" / f"{cache_key(cfg, world)}.json"


def remember(cfg, world: int, records: list) -> None:
    """Keep each rehearsed rank's memory (and coordinates), so that dry_run and perfmodel.py can
    give the measured figure where there is one."""
    path = _memory_cache(cfg, world)
    path.parent.mkdir(parents=True, exist_ok=True)
    known = json.loads(path.read_text()) if path.exists() else {}
    known.update({str(r["rank"]): {"coordinates": r["coordinates"], "memory": r["memory"]} for r in records
                  if not r.get("crash")})
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(known))
    os.replace(tmp, path)


def remembered(cfg, world: int) -> dict:
    """{rank: {"coordinates", "memory"}} of earlier rehearsals of this config at this world size."""
    path = _memory_cache(cfg, world)
    return {int(k): v for k, v in json.loads(path.read_text()).items()} if path.exists() else {}


def main(cfg, overrides: list, run_dir: Path) -> int:
    """Rehearses cfg.rehearse.ranks (each `python train.py <overrides> rehearse.rank=R` in its own
    process, rehearse.parallel_ranks at a time), checks NCCL's rules across them, prints the
    table. Returns 0 when every rank ran clean and fits, else 1."""
    import subprocess
    out = Path(cfg.rehearse.out or run_dir)
    out.mkdir(parents=True, exist_ok=True)
    world = rehearsed_world(cfg)
    started = time.perf_counter()
    pending, running, failed = list(cfg.rehearse.ranks), [], {}
    while pending or running:
        while pending and len(running) < max(1, cfg.rehearse.parallel_ranks):
            rank = pending.pop(0)
            cmd = [sys.executable, str(Path(HERE) / "train.py"), *overrides, f"rehearse.rank={rank}",
                   f"rehearse.world={world}", f"rehearse.out={out}", f"hydra.run.dir={out}/rank{rank}",
                   "logging.wandb.mode=disabled"]
            running.append((rank, subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                   text=True)))
        rank, proc = running.pop(0)
        log = proc.communicate()[0]
        if proc.returncode != 0:
            lines = [l for l in log.strip().splitlines() if not l.startswith("Set the environment variable HYDRA_FULL_ERROR")]
            failed[rank] = lines[-1] if lines else f"exit {proc.returncode}"
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in cfg.rehearse.ranks if r not in failed]
    problems = [f"rank {r}: {why}" for r, why in failed.items()]
    if cfg.rehearse.nccl_rules and records:
        problems += cross_check(records, cfg)
    for rec in records:
        problems += [f"rank {rec['rank']}: {v}" for v in rec["violations"]]
        problems += [f"rank {rec['rank']} crashed: {rec['crash']}"] if rec.get("crash") else []
    remember(cfg, world, records)
    summary = {"world": world, "ranks": cfg.rehearse.ranks, "seconds": time.perf_counter() - started,
               "problems": problems, "table": [table_row(r) for r in records],
               "costs": [{"rank": r["rank"], **r["costs"]} for r in records if "costs" in r]}
    (out / "rehearsal.json").write_text(json.dumps(summary, indent=1))
    print(render(summary, cfg))
    fits = all(rec["memory"]["fits"] for rec in records)
    return 0 if not problems and fits and len(records) == len(cfg.rehearse.ranks) else 1


def cross_check(records: list, cfg) -> list:
    """NCCL's rules across what was rehearsed: the recorded programs together (collectives whose
    other members were not rehearsed are taken to mirror this rank's, as ranks of one stage do),
    and the pipeline plan of the whole layout, which every rehearsed rank's sends and receives
    must follow op by op."""
    from clustermodel import nccl_rules
    from parallelisms import pipeline
    problems = nccl_rules.check({rec["rank"]: program_of(rec) for rec in records}, partial=True)
    p = cfg.parallel
    if p.pp > 1:
        for backward in (True, False):
            problems += [f"pipeline plan ({'training' if backward else 'evaluation'}): {x}" for x in
                         nccl_rules.check(nccl_rules.pipeline_programs(p.pp, p.vpp, p.microbatches, p.overlap.pp, backward))]
        for rec in records:
            problems += follows_plan(rec, p)
    return problems


def program_of(record: dict) -> list:
    from clustermodel.nccl_rules import Op
    program = []
    for ev in record["comm"]:
        if ev["op"] == "wait":
            program.append(("wait", ev["of"]))
        elif ev["op"] == "batch":
            program.append(("post", ev["i"], [op_of(Op, part) for part in ev["ops"]], True))
        elif ev["op"] not in ("host_read",) + OBJECTS:
            program.append(("post", ev["i"], [op_of(Op, ev)], False))
    return program


def follows_plan(record: dict, p) -> list:
    """The rank's recorded sends and receives of one training step, against its plan."""
    from parallelisms import pipeline
    pp_rank = record["coordinates"]["pp"]
    planned = [(s[0], s[2].src if s[0] == "recv" else s[2].dst)
               for s in pipeline.plan(p.pp, pp_rank, p.vpp, p.microbatches, p.overlap.pp) if s[0] in ("send", "recv")]
    peers = {}  # pp rank -> global rank: the recorded peers are global
    done = [(ev["op"], ev["peer"]) for ev in record["comm"] if ev["step"] == 1 and ev["op"] in ("send", "recv")]
    for (kind, pp_peer), (got_kind, got_peer) in zip(planned, done):
        peers.setdefault(pp_peer, got_peer)
        if kind != got_kind or peers[pp_peer] != got_peer:
            return [f"rank {record['rank']}: its sends and receives depart from the pipeline plan "
                    f"({kind} with pp rank {pp_peer} planned, {got_kind} with rank {got_peer} posted)"]
    if len(planned) != len(done):
        return [f"rank {record['rank']}: {len(done)} sends and receives in step 1, the plan has {len(planned)}"]
    return []


def wire_bytes(ev: dict) -> float:
    """Bytes one rank puts on the wire for a recorded operation, as ring algorithms move them:
    all-reduce 2(n-1)/n of the tensor, all-gather (n-1) inputs, reduce-scatter (n-1) outputs,
    broadcast the tensor, a send its tensor, a receive nothing."""
    n, size = len(ev.get("ranks", [1])), ev.get("bytes", 0)
    return {"all_reduce": 2 * (n - 1) / n * size, "all_gather": (n - 1) * size, "reduce_scatter": (n - 1) * size,
            "send": size, "broadcast": size, "all_to_all": (n - 1) / n * size}.get(ev["op"], 0.0)


def comm_per_step(rec: dict, step=None) -> dict:
    """{mesh dimension: wire bytes} of one training step (the last rehearsed: the steady state,
    whose DP gathers under overlap are the previous step's). Hybrid sharding's two groups are
    dp_shard and dp_replicate, and "dp" sums every data-parallel group's."""
    step = rec["steps"] if step is None else step
    per_dim = {}
    for ev in rec["comm"]:
        if ev["step"] != step:
            continue
        for part in ev.get("ops", [ev]):
            if "bytes" in part:
                per_dim[part["group"]] = per_dim.get(part["group"], 0) + wire_bytes(part)
    if "dp_shard" in per_dim or "dp_replicate" in per_dim:
        per_dim["dp"] = sum(v for k, v in per_dim.items() if k.startswith("dp"))
    return per_dim


def table_row(rec: dict) -> dict:
    gib = lambda b: b / 2**30
    m = rec["memory"]
    return {"rank": rec["rank"], **rec["coordinates"], "peak_gib": gib(m["peak_bytes"]), "at": m["at"],
            **{k: gib(m.get(f"{k}_bytes", 0)) for k in ("weights", "gradients", "optimizer", "activations", "communication")},
            "fits": m["fits"], "dominant": m["dominant"], "capacity_gib": gib(m.get("capacity_bytes", 80 * 2**30)),
            "comm_gib": {k: gib(v) for k, v in sorted(comm_per_step(rec).items())},
            "tflops_per_step": sum(rec["flops"]["per_step"].values()) / 1e12,
            "checkpoint_gib": gib(rec["checkpoint_bytes"]), "seconds": rec["seconds"], "rss_gib": gib(rec["rss_bytes"]),
            "costs": _cost_summary(rec.get("costs") or {})}


def _cost_summary(costs: dict) -> dict:
    """What a rank costs beyond its tensors, in a few numbers (rank_costs.py): process groups it is
    in, the checkpoint's peers and a resume check's file-system calls."""
    comms, ckpt = costs.get("communicators") or {}, (costs.get("checkpoint") or {}).get("after", {})
    return {"groups": comms.get("groups"), "p2p_pairs": comms.get("p2p_pairs"), "checkpoint_peers": ckpt.get("sockets"),
            "resume_check_fs_calls": ckpt.get("resume_check_fs_calls")}


def render(summary: dict, cfg) -> str:
    lines = [f"rehearsal of {cfg.model.name} at tp{cfg.parallel.tp} pp{cfg.parallel.pp} vpp{cfg.parallel.vpp} "
             f"dp{summary['world'] // (cfg.parallel.tp * cfg.parallel.pp)} zero{cfg.parallel.zero_stage}, "
             f"{cfg.parallel.microbatches} microbatches, world {summary['world']} (GiB; TP/PP/DP: bytes this rank "
             f"puts on the wire per step)",
             f"| rank | dp,pp,tp | peak | weights | grads | optimizer | activations | comm buffers | fits {capacity_gib(cfg):g} GiB | "
             "TP | PP | DP | TFLOP/step | checkpoint | time |", "|" + "---|" * 15]
    for r in summary["table"]:
        comm = r["comm_gib"]
        lines.append(f"| {r['rank']} | {r['dp']},{r['pp']},{r['tp']} | {r['peak_gib']:.1f} | {r['weights']:.1f} | "
                     f"{r['gradients']:.1f} | {r['optimizer']:.1f} | {r['activations']:.1f} | {r['communication']:.2f} | "
                     f"{'yes' if r['fits'] else 'NO: ' + r['dominant']} | {comm.get('tp', 0):.1f} | {comm.get('pp', 0):.2f} | "
                     f"{comm.get('dp', 0):.2f} | {r['tflops_per_step']:.0f} | {r['checkpoint_gib']:.1f} | {r['seconds']:.0f} s |")
    lines.append("NCCL rules: " + ("kept" if not summary["problems"] else f"{len(summary['problems'])} problems"))
    lines += [f"  {p}" for p in summary["problems"][:20]]
    return "\n".join(lines)
