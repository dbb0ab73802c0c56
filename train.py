"""Train a GPT the way MegaScale does, one switch per technique.

    python train.py                                   # the tiny model on this machine's CPU
    python train.py model=175B dry_run=true           # size, FLOPs and memory with no hardware
    python -m corpus build                            # the corpus, once: a job of several ranks never builds
    torchrun --nproc_per_node 2 train.py              # data parallel on 2 processes
    srun -n 16 python train.py ...                    # SLURM: ranks come from SLURM_* variables

Every run writes metrics.jsonl and run.json to its Hydra run dir (the source of truth for tables)
and logs to W&B (offline by default). Bad input is one line on stderr and exit code 2.
"""
from __future__ import annotations

import gc

_GC_WAS_ENABLED = gc.isenabled()
gc.disable()  # until the imports are done: see gc.freeze() below

import contextlib
import dataclasses
import logging
import os
import random
import sys
import time
import types
from pathlib import Path
from typing import Optional

import hydra
import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import checkpoint
import config
import data
import fault_injection
import kernels
import launch
import machine
import metrics
import optim
import parallel
import sampling
from corpus import blend
from errors import ConfigError, fail
from model import GPT, count_params, flops_per_token, matmul_params
from observe import heartbeat, oplog, spans, stragglers

# The imports above leave ~300k objects that live as long as the process (torch, DCP, dynamo).
# Python's collector would walk every one at each full collection: several during the imports,
# then each of the run's periodic collections (launch.CollectGarbage) and the last one at shutdown
# (launch.shutdown), on every rank. Frozen, they are skipped: later collections walk only what the
# run itself made (experiments/results/startup.md measures both).
gc.freeze()
if _GC_WAS_ENABLED:
    gc.enable()

log = logging.getLogger("train")


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(dict_cfg) -> float:
    """What the command asks for, by the first row of JOBS that matches: a rehearsal, a dry run,
    a pending study row, else training. Returns what a Hydra sweeper optimises."""
    from hydra.core.hydra_config import HydraConfig
    cfg = config.to_object(dict_cfg)
    connections = launch.set_cuda_connections(cfg.parallel.tp, cfg.hardware.device)  # before anything starts CUDA
    if connections:
        log.warning(connections)
    try:
        config.validate(cfg)
    except ConfigError as err:  # a multirun job composed from a sweep: same one-line rule
        fail(str(err))
    job = next(job for asked, job in JOBS if asked(cfg))
    return job(cfg, Path(HydraConfig.get().runtime.output_dir))


def rehearse_one_rank(cfg: config.Config, run_dir: Path) -> float:
    """rehearse.rank=N: one rank of a rehearsal (clustermodel/rehearsal.py), in its own process."""
    from clustermodel import rehearsal
    rehearsal.rehearse_rank(cfg, cfg.rehearse.rank, cfg.rehearse.world, Path(cfg.rehearse.out))
    return 0.0


def rehearse(cfg: config.Config, run_dir: Path) -> float:
    """rehearse.ranks=[...]: those ranks of the job rehearsed on this CPU, NCCL's rules checked."""
    from hydra.core.hydra_config import HydraConfig
    from clustermodel import rehearsal
    code = rehearsal.main(cfg, list(HydraConfig.get().overrides.task), run_dir)
    if code:
        sys.exit(code)
    return 0.0


def dry_run(cfg: config.Config, run_dir: Path) -> float:
    """dry_run=true: size, FLOPs and memory per GPU, with no hardware (clustermodel/dry_run.py)."""
    from clustermodel import dry_run as sizes
    sizes.report(cfg)
    return 0.0


def record_pending(cfg: config.Config, run_dir: Path) -> float:
    """study.pending: the study row's run.json says pending (metrics.record_pending); nothing trains."""
    metrics.record_pending(cfg, run_dir, config.world_size())
    return float("nan")


def train_job(cfg: config.Config, run_dir: Path) -> float:
    """The training run (train); its validation loss, else its loss."""
    problem = next(filter(None, (data.build_problem(source, config.world_size(), cfg.model.vocab_size)
                                 for source in blend.source_configs(cfg.data))), None)
    if problem:  # before any process group: one open of the manifest per rank (a source's)
        fail(problem)
    result = train(cfg, run_dir)
    return result.get("val_loss", result.get("loss", float("nan")))


JOBS = [  # (whether the config asks for it, the job): the first that matches runs
    (lambda cfg: cfg.rehearse.rank >= 0, rehearse_one_rank),
    (lambda cfg: bool(cfg.rehearse.ranks), rehearse),
    (lambda cfg: cfg.dry_run, dry_run),
    (lambda cfg: cfg.study.pending, record_pending),
    (lambda cfg: True, train_job),
]


def train(cfg: config.Config, run_dir: Path) -> dict:
    """The training run, phase by phase: set-up, resume, the loop (each step, with evaluation and
    checkpoints as they fall due), the last checkpoint, and the finish. Returns the final metrics
    (also written to run.json)."""
    run = set_up(cfg, run_dir)
    start = resume(cfg.resume, run.ckpt_dir, run.engine, run.optimizer, run.scheduler, run.loader, run.saver.group,
                   cfg.model)
    open_run_log(run, start)
    loop = Loop(run, start)
    try:
        loop.run_steps()
        loop.save_last()
    except BaseException:  # a crash or a second Ctrl-C: the tables must say failed, not running
        run.log.finish("failed", metrics.summarize(loop.history, loop.step))
        launch.mark_failed()
        raise
    finally:
        loop.close()
    return finish(run, loop)


@dataclasses.dataclass(kw_only=True)
class Run:
    """What the set-up builds and every later phase reads."""
    cfg: config.Config
    run_dir: Path
    device: torch.device
    rank: int
    world: int
    layout: parallel.Layout
    precision: str                # "bf16" or "fp32", the same on every rank
    autocast_dtype: torch.dtype
    corpus: data.Corpus
    loader: object                # the training batches (sampling.train_loader)
    engine: parallel.ParallelModel
    optimizer: torch.optim.Optimizer
    scheduler: object
    ckpt_dir: Path
    saver: checkpoint.Saver
    compiling: bool
    n_params: int
    allocator: str                # the log's words for the host allocator
    backends: dict                # what computed the run (what_computed; rank 0's, empty elsewhere)
    log: Optional[metrics.RunLog] = None       # open_run_log's
    meter: Optional[metrics.StepMeter] = None  # open_run_log's


def set_up(cfg: config.Config, run_dir: Path) -> Run:
    """Processes, devices and mesh; every generator seeded; the data; the model, cut to this rank's
    share, and its optimizer; the checkpoint saver."""
    device = launch.pick_device(cfg.hardware.device)
    allocator = host_allocator(cfg.hardware, device)
    rank, world = launch.init_distributed(device, cfg.hardware.backend, timeout_s=cfg.ft.collective_timeout)
    layout = parallel.build_layout(cfg.parallel, rank, world, device, timeout_s=cfg.ft.collective_timeout)
    seed_generators(cfg.train.seed, rank)
    precision = _agreed_precision(cfg.precision, device, world)
    autocast_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    corpus, loader = set_up_data(cfg, layout, device)
    engine, compiling, n_params = set_up_model(cfg, layout, device, autocast_dtype, allocator)
    backends = what_computed(cfg, device, autocast_dtype, precision, compiling) if rank == 0 else {}
    optimizer = optim.build_optimizer(engine.named_optimizer_parameters(), cfg.optim, cfg.train.lr,
                                      norm_group=engine.norm_group, clock=layout.clock)
    scheduler = optim.build_scheduler(optimizer, cfg.optim, cfg.train.max_steps)
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    saver = checkpoint.Saver(ckpt_dir, cfg.checkpoint.keep, cfg.checkpoint.async_save, cfg.ft.collective_timeout)
    return Run(cfg=cfg, run_dir=run_dir, device=device, rank=rank, world=world, layout=layout, precision=precision,
               autocast_dtype=autocast_dtype, corpus=corpus, loader=loader, engine=engine, optimizer=optimizer,
               scheduler=scheduler, ckpt_dir=ckpt_dir, saver=saver, compiling=compiling, n_params=n_params,
               allocator=allocator, backends=backends)


def seed_generators(seed: int, rank: int) -> None:
    """Every generator a rank has, so that two runs of one config write identical checkpoints. Each
    rank gets its own torch stream: dropout (model.dropout) must draw different masks for the
    heads and sequence slices each TP rank holds, and for each pipeline stage's layers (Megatron's
    RNG tracker offsets by rank for the same reason). Weights never come from it: init_weights
    draws each slice of each parameter from a generator keyed by its name, so every rank draws
    its share of the one model a single process would build."""
    torch.manual_seed(seed + rank)
    random.seed(seed + rank)
    np.random.seed(seed + rank)


def set_up_data(cfg: config.Config, layout, device: torch.device) -> tuple:
    """(the corpus, the training batches). One process builds the corpus on first use; the ranks
    of a larger job open its build (sampling.open_corpus)."""
    corpus = sampling.open_corpus(cfg.data, cfg.train.seq_len, layout.rank, layout.world)
    if cfg.model.vocab_size < corpus.vocab_size:
        fail(f"config error: model.vocab_size: {cfg.model.vocab_size} is smaller than the tokenizer's "
             f"{corpus.vocab_size}. Fix: set model.vocab_size>={corpus.vocab_size}")
    sequences = corpus.num_sequences("train", cfg.train.seq_len)
    if sequences < cfg.train.batch_size and layout.rank == 0:
        log.warning("data: the training split holds %d sequences of %d tokens, fewer than one global batch of %d: "
                    "each step repeats sequences (%.1f times each)", sequences, cfg.train.seq_len,
                    cfg.train.batch_size, cfg.train.batch_size / sequences)
    index = sampling.shared_index(corpus, cfg.data, cfg.train.seq_len, cfg.train.seed,
                                  cfg.train.max_steps * cfg.train.batch_size, layout.rank, layout.world)
    sampler = sampling.Sampler(index, cfg.train.batch_size, layout.dp_rank, layout.dp)
    loader = sampling.train_loader(corpus, cfg.data, cfg.train.seq_len, sampler,
                                   layout.group("tp") if layout.tp > 1 else None, layout.tp_rank, device,
                                   layout.pp_rank, layout.pp)
    return corpus, loader


def set_up_model(cfg: config.Config, layout, device: torch.device, dtype: torch.dtype, allocator: str) -> tuple:
    """(the engine, whether it is compiled, the model's parameter count). The model is built on the
    meta device, cut to this rank's share (PP chunks, TP slices), and only that is materialized and
    initialized; ZeRO's buffers come from outside (parallel.build)."""
    with torch.device("meta"):
        model = GPT(cfg.model, cfg.kernels)
    n_params = count_params(model)
    engine = parallel.build(model, layout, cfg.parallel, recompute=cfg.train.recompute, fused=cfg.kernels.fused,
                            dtype=dtype, recompute_layers=cfg.train.recompute_layers, device=device, seed=cfg.train.seed)
    compiling, why = compile_choice(cfg.train.compile, device, cfg.parallel.zero_stage)
    if compiling:
        options, note = compile_mode_choice(cfg.train.compile_mode, device)
        why += f": torch.compile of {engine.compile(**options)}{note}"
    elif cfg.train.compile_mode != "default":
        why += f"; train.compile_mode={cfg.train.compile_mode} unused: the step runs eager"
    if layout.rank == 0:
        log.info("%s; %s", why, allocator)
    return engine, compiling, n_params


def open_run_log(run: Run, start: int) -> None:
    """run.json's record of the run and the step meter (throughput and MFU), on run.log and
    run.meter. MFU is rank 0's to log, and so is the measurement of a CPU's peak: ranks measuring
    side by side on shared cores would each see a fraction of it (and cost a second of start-up
    each)."""
    cfg, layout, rank = run.cfg, run.layout, run.rank
    fpt = flops_per_token(cfg.model, cfg.train.seq_len)
    peak, peak_source = machine.peak_tflops(run.device, run.autocast_dtype, cfg.hardware.peak_tflops,
                                            cfg.hardware.peak_tflops_fp32) if rank == 0 else (float("nan"), "rank 0's")
    run.meter = metrics.StepMeter(cfg.train.batch_size * cfg.train.seq_len, fpt, run.world, peak)
    record = {"config": OmegaConf.to_container(OmegaConf.structured(cfg)), "git": metrics.git_commit(),
              "study": dataclasses.asdict(cfg.study),
              "versions": metrics.versions(), "device": str(run.device), "precision": run.precision,
              "world_size": run.world,
              "layout": {**layout.coordinates(), "dp_size": layout.dp, "pp_size": layout.pp, "tp_size": layout.tp,
                         "order": list(cfg.parallel.order), "group_setup_s": layout.setup_seconds,
                         "ranks": layout.all_coordinates()},
              "params": run.n_params, "matmul_params": matmul_params(cfg.model), "flops_per_token": fpt,
              "peak_tflops": peak, "peak_source": peak_source, "allocator": run.allocator, "data": run.corpus.meta,
              "backends": run.backends}
    run.log = metrics.RunLog(run.run_dir, record, cfg.logging.wandb, enabled=rank == 0)
    if rank == 0:
        log.info("run dir %s | %s params | %.3g FLOPs/token | world %d (dp %d, pp %d, tp %d) | %s | peak %.3g TFLOP/s (%s)",
                 run.run_dir, f"{run.n_params:,}", fpt, run.world, layout.dp, layout.pp, layout.tp, run.precision,
                 peak, peak_source)


class StepRecording:
    """rehearse.record: for the run's first rehearse.steps steps, the recorder
    (clustermodel/recorder.py) of every collective and host read a step makes after its batch is
    read (where a rehearsal's step starts: it has no loader), its steps numbered from the resumed
    step, written to `path` after the last, so that the rehearsal of this run can be compared with
    it op by op."""

    def __init__(self, recorder, first: int = 0, recorded: int = 0, path: Optional[Path] = None):
        self.recorder, self.first, self.last, self.path = recorder, first, first + recorded, path

    @contextlib.contextmanager
    def of(self, step: int):
        """The recorder, recording inside the block, while `step` is one of those recorded; else a
        stand-in that records nothing. Either names the step's one host read (named_read)."""
        if self.recorder is None or step > self.last:
            yield NOT_RECORDING
            return
        self.recorder.step = step - self.first
        with self.recorder:
            yield self.recorder
        if step == self.last:
            self.recorder.write(self.path)


NOT_RECORDING = types.SimpleNamespace(named_read=contextlib.nullcontext)


def step_recording(cfg: config.Config, run: Run, start: int) -> StepRecording:
    """rehearse.record: what this real run posts in its first rehearse.steps steps, recorded in
    the form a rehearsal records it (clustermodel/recorder.py); nothing recorded without it."""
    if not cfg.rehearse.record:
        return StepRecording(None)
    from clustermodel.recorder import Recorder
    recorder = Recorder(run.layout, run.device, fake=False, nccl_rules=cfg.rehearse.nccl_rules)
    return StepRecording(recorder, start, cfg.rehearse.steps, run.run_dir / "comm" / f"rank{run.rank}.json")


class Loop:
    """The training loop and what runs beside its steps: the stop flag (signals), the op log and
    its spans (oplog.py), the heartbeat, the planned faults, the synchronised GC, the progress
    bar, the held-out batches. close() ends every thread it started."""

    def __init__(self, run: Run, start: int):
        cfg, layout = run.cfg, run.layout
        self.run, self.start, self.step, self.history, self.status = run, start, start, [], "finished"
        self.stop = launch.StopFlag()
        first_step_work = ", ".join(["torch.compile of every chunk"] * run.compiling +
                                    ["the communicators' set-up"] * (run.world > 1))
        # the op log and spans (None without observe.ops), written by the heartbeat
        spans = oplog.span_capacity(cfg, parallel.rank_layers_most(cfg))
        self.observer = oplog.start(cfg.observe, layout, run.run_dir, run.device, spans,
                                    fault_injection.planned_faults())
        if self.observer is not None and cfg.observe.spans:
            layout.clock.on_wait, layout.clock.describe = self.observer.wait_span, self.observer.wait_label
        self.beat = heartbeat.Heartbeat(run.run_dir, run.rank, run.world, cfg.ft, first_step_work, self.observer)
        self.faults = fault_injection.Faults(run.rank, run.run_dir)
        self.collector = launch.CollectGarbage(cfg.train.gc_interval)
        self.detector = straggler_detector(cfg, run)
        timed = self.detector.timed if self.detector is not None else None
        slowing = self.faults.slowing(lambda: self.beat.step, layout.clock)  # None unless slow:/spike: name this rank
        run.engine.around_compute = [hook for hook in (timed, slowing) if hook]  # outermost first: timed sees the slowing
        self.recording = step_recording(cfg, run, start)
        self.max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
        self.bar = _progress(cfg, run.rank, start)
        self.eval_set = sampling.eval_batches(run.corpus, cfg.train.seq_len, cfg.train.eval_batches,
                                              cfg.train.batch_size, layout.dp_rank, layout.dp,
                                              pin_memory=run.device.type == "cuda") \
            if cfg.train.eval_interval > 0 else []

    def run_steps(self) -> None:
        """Steps to train.max_steps, each followed by what falls due (evaluation, the health checks,
        the row of metrics, a checkpoint), or until the ranks agree to stop (a signal: status
        "interrupted")."""
        cfg, run = self.run.cfg, self.run
        for step in range(self.start + 1, cfg.train.max_steps + 1):
            self.step = step
            row, stop_now, timing, data_s = self.run_step(step)
            if self.eval_set and (step % cfg.train.eval_interval == 0 or step == cfg.train.max_steps):
                self.beat.progress(step, "eval")
                row["val_loss"] = evaluate(run.engine, self.eval_set, run.device, run.autocast_dtype, run.layout)
            row.update(health(step, timing, data_s, self.collector, self.detector, run.rank))
            run.log.step(row)
            self.history.append(row)
            _report(row, cfg, self.bar, run.rank)
            if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0:
                self.save(step)
            self.faults.after_step(step, run.ckpt_dir, run.saver)
            if stop_now:
                self.status = "interrupted"
                log.warning("stop requested: saving a checkpoint at step %d and exiting cleanly (%s)",
                            step, self.stop.signal_name or "another rank's signal")
                return

    def run_step(self, step: int) -> tuple:
        """One optimizer step, in order: the clock starts; the batch is read (inside the clock's
        span: a slow loader shows in the step's time; its own seconds are the straggler detector's
        data time); forward and backward; the gradients reduced and clipped; the update and the
        learning rate's next value; the ranks' agreement and the step's one host read, which ends
        the clock's span. Returns its row of metrics, whether the ranks agreed to stop, the clock's
        figures (timing) and the batch's seconds."""
        run, engine, clock = self.run, self.run.engine, self.run.layout.clock
        clock.start_step(run.device)
        self.beat.progress(step, "data")
        reading = time.perf_counter()
        batch = next(run.loader)
        data_s = time.perf_counter() - reading
        self.beat.progress(step, "compute")
        with self.recording.of(step) as recorder:
            inputs, targets = sampling.to_device(batch, run.device)
            loss = engine.forward_backward(inputs, targets, run.autocast_dtype)
            grad_norm = engine.finish_gradients(self.max_norm)
            engine.optimizer_step(run.optimizer)
            run.scheduler.step()
            agreed = parallel.agree(loss, self.stop.requested, run.layout, grad_norm)
            with recorder.named_read():
                (loss, stop_now, grad_norm), timing = clock.end_step(run.device,
                                                                     lambda: parallel.read_agreed(agreed, run.layout))
        row = {"step": step, "loss": loss, "lr": run.scheduler.get_last_lr()[0], "grad_norm": grad_norm,
               **run.meter(timing["step_s"]), **metrics.breakdown(timing), "memory_gib": metrics.memory_gib(run.device),
               **metrics.memory_reserved(run.device)}
        return row, stop_now, timing, data_s

    def save(self, step: int) -> None:
        self.beat.progress(step, "checkpoint")
        self.faults.before_save(step, self.run.saver)
        save(self.run.saver, step, self.run.engine, self.run.optimizer, self.run.scheduler, self.run.loader,
             self.run.cfg)

    def save_last(self) -> None:
        """The stop's checkpoint, or the last step's where checkpoints are on and it was not saved
        yet; then an asynchronous save still being written completes before the run ends."""
        run, step = self.run, self.step
        if step > self.start and (self.status == "interrupted" or run.cfg.checkpoint.interval) \
                and run.saver.last_step != step:
            self.save(step)
        run.saver.wait()
        self.beat.progress(step, "done")

    def close(self) -> None:
        """Every thread the run started ends here, in this order (launch.shutdown says the rest)."""
        self.run.loader.close()
        self.run.saver.close()
        self.beat.close()
        self.run.layout.clock.on_wait = self.run.layout.clock.describe = None
        oplog.stop(self.observer)
        self.collector.close()
        if self.bar is not None:
            self.bar.close()
        self.stop.restore()


def finish(run: Run, loop: Loop) -> dict:
    """The final metrics in run.json and rank 0's last line; after a stop, the launcher's handlers
    held back (a requeue) run now that the checkpoint is saved. The process group stays up for the
    next job of a multirun (launch.init_distributed)."""
    final = metrics.summarize(loop.history, loop.step)
    final["checkpoint_stall_s"] = run.saver.stall_s  # how long each save held training up
    final["checkpoint_failed_steps"] = run.saver.failed
    if run.compiling:  # what torch.compile made of the chunks (0: nothing ran compiled), its breaks and recompiles
        final["compiled_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        final["dynamo"] = metrics.dynamo_counters()
    run.log.finish(loop.status, final)
    if run.rank == 0:
        print(metrics.final_line(final, run.cfg), flush=True)
    if loop.status == "interrupted":
        loop.stop.hand_back()
    return final


def straggler_detector(cfg: config.Config, run: Run) -> Optional[stragglers.Detector]:
    """The straggler detector (observe/stragglers.py), or None without ft.straggler_interval."""
    if not cfg.ft.straggler_interval:
        return None
    return stragglers.Detector(run.layout, cfg.ft.straggler_interval, cfg.ft.straggler_threshold,
                               cfg.ft.straggler_windows, run.device, run.run_dir,
                               predicted_stage_compute(cfg, run.layout, run.device))


def predicted_stage_compute(cfg: config.Config, layout, device: torch.device) -> Optional[list]:
    """Each pipeline stage's compute a step as the performance model predicts it, at start-up: what
    the straggler detector divides a rank's measured compute by. Rank 0 prices it (from its host's
    rates) and broadcasts it once, so every rank divides by the same figures and all or none of
    them join the detector's histogram all-reduce. None, logged, where the model cannot price the
    config (the dp groups' comparison still runs)."""
    figures = torch.zeros(1 + layout.pp, dtype=torch.float64, device=device)  # [priced?, stage 0, ...]
    if layout.rank == 0:
        from clustermodel import predicted
        try:
            figures[0], figures[1:] = 1.0, torch.tensor(predicted.stage_compute_s(cfg, layout.world), dtype=torch.float64)
        except Exception as e:  # noqa: BLE001 - a config the model does not price
            log.warning("no predicted compute per stage (%s: %s): compute is compared within dp groups only",
                        type(e).__name__, e)
    if layout.world > 1:
        dist.broadcast(figures, src=0)
    figures = figures.tolist()  # once, at start-up
    return figures[1:] if figures[0] else None


def health(step: int, timing: dict, data_s: float, collector, detector, rank: int) -> dict:
    """The synchronised GC (its time) and the straggler verdicts confirmed at this step (observe/stragglers.py:
    the rank, the kind, its slowdown over its peers and its cost to the step), logged by rank 0."""
    out = {"gc_s": collector.after_step(step)}
    if detector is not None:
        verdicts = detector.step(step, timing, data_s)
        if rank == 0:
            out.update(stragglers.log_verdicts(verdicts, step))
    return out


@torch.no_grad()
def evaluate(engine, batches, device, autocast_dtype, layout) -> float:
    total = sum(engine.forward_backward(*sampling.to_device(stream, device), autocast_dtype, backward=False)
                for stream in batches)
    return parallel.read_agreed(parallel.agree(total / len(batches), False, layout), layout)[0]


def _agreed_precision(requested: str, device: torch.device, world: int) -> str:
    """precision=auto on a CPU is a measurement (machine.resolve_precision), taken on rank 0 and
    broadcast: ranks measuring side by side on shared cores could decide differently, and ranks in
    two precisions would exchange tensors of two dtypes. (On CUDA, and when asked, no measurement.)"""
    if requested != "auto" or world == 1 or device.type == "cuda":
        return machine.resolve_precision(requested, device)
    bf16 = torch.zeros(1, dtype=torch.int32, device=device)
    if dist.get_rank() == 0:
        bf16.fill_(machine.resolve_precision(requested, device) == "bf16")
    dist.broadcast(bf16, src=0)
    return "bf16" if bf16.item() else "fp32"


def host_allocator(hardware: config.HardwareConfig, device: torch.device) -> str:
    """Set up the allocator of the memory the step's tensors live in; returns the log's words."""
    if device.type != "cpu":
        return "allocator: torch's caching allocator"
    if not hardware.keep_freed_memory:
        return "allocator: glibc's defaults (hardware.keep_freed_memory=false)"
    return machine.keep_freed_memory()


def what_computed(cfg: config.Config, device: torch.device, dtype: torch.dtype, precision: str, compiled: bool) -> dict:
    """What computed the run, for run.json and the tables under each study: the attention backend
    (and SDPA's kernel, kernels.describe_attention), the precision, whether fp32 matmuls were
    allowed TF32 (CUDA; None elsewhere), whether the step was compiled, the fused operators. Logs
    it, and warns where kernels.attention=auto did not get flash-attn on a GPU. (No torch.backends
    here: submitit pickles this file's functions by value, and that module cannot be pickled.)"""
    m = cfg.model
    attention = kernels.describe_attention(cfg.kernels.attention, device, dtype, cfg.train.seq_len, m.d_model // m.n_heads,
                                           m.attention.window, m.dropout, cfg.kernels.attention_block)
    ran = {"attention": attention, "precision": precision, "compiled": compiled, "fused": cfg.kernels.fused,
           "tf32": machine.tf32_matmuls() if device.type == "cuda" else None}
    log.info("attention %s%s | %s | TF32 %s | %s", attention["ran"],
             f" (SDPA: {attention['sdpa_kernel']})" if attention["sdpa_kernel"] else "", precision,
             {True: "on", False: "off", None: "n/a"}[ran["tf32"]], "compiled" if compiled else "eager")
    if attention["fallback"]:
        log.warning("kernels.attention=auto runs %s on this GPU, not flash-attn: %s (run.json: backends)",
                    attention["ran"], attention["fallback"])
    return ran


def compile_mode_choice(mode: str, device: torch.device) -> tuple:
    """(torch.compile's options, what the log line adds) for train.compile_mode. reduce-overhead
    records the compiled step as CUDA graphs, one launch for a graph's kernels, which pays where a
    step is launch-bound; CUDA graphs exist on CUDA only, so elsewhere the step compiles as default."""
    if mode == "default":
        return {}, ""
    if device.type != "cuda":
        return {}, (f"; train.compile_mode={mode}: no CUDA graphs on {device.type.upper()}, the step compiles "
                    "as mode=default")
    return {"mode": mode}, f"; train.compile_mode={mode}: the step recorded as CUDA graphs"


def compile_choice(setting, device: torch.device, zero_stage: int = 0) -> tuple:
    """(whether to torch.compile, the log line saying why). train.compile=true or false is obeyed;
    null, the default, picks the faster of the two as experiments/bench_step.py measures them
    (experiments/results/bench_step.md): compiled on CUDA, eager on a CPU, where compiled steps are
    no faster and compiling costs start-up time. ZeRO-3's gather and free hooks run eager."""
    if setting is not None:
        return setting, f"train.compile={str(setting).lower()}"
    if zero_stage == 3:
        return False, "train.compile=auto: eager at parallel.zero_stage=3, whose gather and free hooks run eager"
    if device.type == "cuda":
        return True, "train.compile=auto: compiled on CUDA, where it measured faster than eager"
    return False, (f"train.compile=auto: eager on {device.type.upper()}, where compiled steps measured no faster "
                   "and compiling costs start-up time (train.compile=true compiles anyway)")


# --- Checkpoints ---

def save(saver, step, engine, optimizer, scheduler, loader, cfg) -> None:
    """Every rank saves its pieces (checkpoint.py); with checkpoint.async_save this returns once
    they are copied to host memory."""
    config_dict = OmegaConf.to_container(OmegaConf.structured(cfg))
    with spans.segment("checkpoint save"):  # what the save holds training up (an async save: its copy to host)
        saver.save(step, checkpoint.training_state(step, engine, optimizer, scheduler, loader, config_dict))


def resume(how: str, ckpt_dir: Path, engine, optimizer, scheduler, loader, group, model_cfg=None) -> int:
    """Load a checkpoint if asked (resume=auto|PATH, saved at any layout) and return its step.
    The ranks verify the checksums together, each reading its share of the files, and every rank
    loads the folder that passes."""
    if how == "none":
        return 0
    if how == "auto":
        folder = checkpoint.latest(ckpt_dir, group=group)  # the newest that verifies
        if folder is None:
            return 0
    else:
        folder = Path(how)
        why = checkpoint.problem(folder, group=group)
        if why is not None:
            fail(f"config error: resume: {why}. Fix: give a step folder with a complete manifest.json, or resume=auto|none")
    why = checkpoint.model_mismatch(folder, model_cfg)
    if why is not None:  # every rank reads the same config, so every rank stops here
        fail(f"config error: resume: {why}. Fix: resume a checkpoint of this model (the same model=), or resume=none")
    try:
        step = checkpoint.load(folder, engine, optimizer, scheduler, loader, group)
    except ConfigError as err:  # found by every rank alike (the saved shapes are the same for all)
        fail(str(err))
    log.info("resumed from %s (step %d)", folder, step)
    return step


# --- Reporting ---

def _report(row: dict, cfg, bar, rank: int) -> None:
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{row['loss']:.3f}", refresh=False)
    if rank == 0 and (row["step"] % cfg.logging.interval == 0 or row["step"] == 1 or "val_loss" in row):
        val = f" | val {row['val_loss']:.3f}" if "val_loss" in row else ""
        line = (f"step {row['step']:>5} | loss {row['loss']:.4f}{val} | lr {row['lr']:.2e} | "
                f"{row['tokens_per_s']:,.0f} tok/s | MFU {100 * row['mfu']:.1f}%")
        (bar.write if bar is not None else print)(line)
        log.debug(line)


def _progress(cfg, rank: int, start: int):
    if rank != 0 or not cfg.logging.progress or not sys.stderr.isatty():
        return None
    from tqdm import tqdm
    return tqdm(total=cfg.train.max_steps, initial=start, desc="train", dynamic_ncols=True, leave=False)


def _pickle_config_modules_by_name() -> None:
    """The submitit launcher cloudpickles this file's functions by value, with every loaded submodule
    of a module they use whose last name they also use: `dist` and `config` bring in
    torch.distributed.config, a torch config module (a ModuleType subclass) that pickle cannot
    copy. Such modules travel by name (the job imports them again)."""
    import copyreg
    import importlib
    for module_type in {type(m) for m in list(sys.modules.values()) if isinstance(m, types.ModuleType)} - {types.ModuleType}:
        copyreg.pickle(module_type, lambda module: (importlib.import_module, (module.__name__,)))


def precheck_submissions(argv: list) -> None:
    """Before the submitit launcher queues anything: each SLURM job's rank 0 rehearsed here
    (rehearse.precheck), and a failing layout stopped with one line."""
    jobs = config.preflight(argv)
    slurm = [(overrides, cfg, world) for overrides, cfg, world in jobs if world is not None and cfg.rehearse.precheck]
    if not slurm:
        return
    import tempfile
    from clustermodel import rehearsal
    print(f"precheck: rehearsing rank 0 of {len(slurm)} job(s) before submitting (rehearse.precheck=false skips)",
          flush=True)
    why = rehearsal.precheck(slurm, Path(tempfile.mkdtemp(prefix="megarepro-precheck-")))
    if why:
        fail(f"precheck failed: {why}. Fix: change the layout, or rehearse.precheck=false to submit anyway")


def prepare_multirun() -> None:
    """A sweep (-m): the config modules pickle by name, and the sweep dir's name is fixed now: the
    submitit launcher's jobs re-resolve hydra.sweep.dir in their own processes (under SLURM, where
    ${run_id:} would name their array job instead), and they inherit this environment."""
    _pickle_config_modules_by_name()
    os.environ.setdefault("MEGAREPRO_RUN_ID", config.run_id())


if __name__ == "__main__":
    config.register()  # the schema and the YAML's resolvers, for every composition below (Hydra's too)
    precheck_submissions(sys.argv[1:])
    if {"-m", "--multirun"} & set(sys.argv[1:]):
        prepare_multirun()
    main()
