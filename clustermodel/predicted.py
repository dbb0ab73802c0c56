"""What the performance model predicts each rank's step looks like, laid beside what it measured:
the replay (clustermodel/replay.py) of the run's rehearsal, segment by segment.

    python -m clustermodel.predicted RUN_DIR   # RUN_DIR/observe/predicted.json, then python oplog.py RUN_DIR with it,
                                               # compute stragglers priced by a what-if replay

The rehearsal is the one `python -m clustermodel validate RUN_DIR` keeps in RUN_DIR/rehearsal/
(each pipeline stage's first rank, its collectives, sends, receives and waits stamped with the
compute between them), made here when it is not there (a few seconds for a small model: one rank
per stage on the meta device). A rehearse.record=true run's own record (RUN_DIR/comm/) is not
used: a real run's record carries no compute to price.

The replay runs the rehearsed steps once; its last (steady) step, from the end of the one before,
is what predicted.json keeps per pipeline stage: compute between operations as "compute", each
wait named as the measured waits are ("comm tp", "bubble pp recv", ...). oplog.py lays it at the
start of each step a rank measured (timeline.lay_predicted); ranks of one stage share their
stage's program. This is apart from oplog.py because the cluster model imports the config,
which imports oplog.py."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Dict, List, Optional

from clustermodel import perfmodel as pm
from clustermodel import rates, replay
from clustermodel.schema import PerfModelHardware
from errors import ConfigError


# A 2-core Xeon VM's numbers as machine.local_measurements measured them, for a CPU whose own are neither
# given nor cached (only the stages' ratios are read from them)
NOMINAL_CPU = {"peak_tflops": 0.1, "peak_tflops_fp32": 0.15, "memory_gib": 16.0, "memory_GBps": 15.0,
               "memory_efficiency": 0.4, "op_overhead_us": 4.0, "gemm_half_dim": 36.0, "gemm_efficiency": 1.0,
               "flash_efficiency": 0.34, "intra_host_GBps": 0.7, "inter_host_Gbps": 11.0}
COMM = ("tp_comm", "pp_comm", "hidden")  # a microbatch's parts that are waits (timed apart), not compute


def stage_compute_s(cfg, world: int) -> List[float]:
    """Seconds the performance model predicts each pipeline stage computes in a step: its layers'
    forward and backward (recomputation included) over its microbatches, the first stage's
    embedding, the last stage's head and loss, waits left out. The straggler detector divides a
    rank's measured compute by its stage's figure, and so does the heat map; both compare that
    ratio across ranks, so only the stages' ratios to one another must be right. It measures
    nothing (a training rank calls it at start-up): a CPU's unknown rates are this machine's cached
    measurements (machine.local_measurements'), else NOMINAL_CPU's."""
    hw = _unmeasured(cfg.hardware)
    lay = pm.layout_of(cfg, world)
    cfg = pm.resolve_config(cfg, hw)
    r, net = pm.Rates.of(hw, pm.precision(cfg), lay.gpus), pm.Network(hw, lay)
    first, last = pm.stage_microbatch(cfg, lay, r, net)
    (emb_f, emb_b), _ = pm.ends_time(cfg, lay, r, net)
    busy = lambda part: sum(v for k, v in part.items() if k not in COMM)
    middle = busy(first) - busy(emb_f) - busy(emb_b)
    stages = [busy(first)] + [middle] * (lay.pp - 2) + ([busy(last)] if lay.pp > 1 else [])
    return [lay.microbatches * s for s in stages]


def _unmeasured(hw):
    """hw resolved as rates.resolve_hardware resolves it, what it would measure on a CPU taken from
    the cache or NOMINAL_CPU; a machine that cannot be resolved so (a GPU cluster without its fit)
    is priced as a nominal CPU."""
    import machine
    hw = copy.deepcopy(hw)
    on_cpu = hw.device == "cpu" or (hw.device == "auto" and not rates._cuda_available())
    if not on_cpu:
        try:
            return pm.resolve_hardware(hw)
        except ConfigError:
            hw.device, hw.perfmodel = "cpu", PerfModelHardware()
    if hw.perfmodel == PerfModelHardware():
        hw.perfmodel = rates.this_cpu()
    cached = machine.cache_dir() / "cpu_local.json"
    known = {**NOMINAL_CPU, **(json.loads(cached.read_text())["measured"] if cached.exists() else {})}
    for key in rates.MEASURED + rates.MEASURED_FP32:
        if getattr(rates.owner(hw, key), key) is None:
            setattr(rates.owner(hw, key), key, known.get(key))
    link = hw.perfmodel
    if link.inter_host_efficiency is None:  # an emulated link: its calibration where cached, else placeholders
        try:
            rates.calibrated_link(link)
        except ConfigError:  # the link's figures are no part of compute
            link.inter_host_efficiency, link.p2p_efficiency, link.overlap_slowdown = 1.0, 1.0, 0.0
            link.inter_host_latency_us = link.inter_host_latency_us or link.intra_host_latency_us
    return pm.resolve_hardware(hw)


class _Traced(replay.Replay):
    """The replay, keeping when each rank computed and waited: {rank: [(kind, name, step, start, end)]}."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.segments: Dict[int, list] = {r: [] for r in self.ranks}
        self._computing: Dict[int, Optional[float]] = {}  # rank -> when its current segment of compute began

    def _advance(self, rank, now: float) -> bool:
        if rank.done():
            return False
        ev, fresh, since = rank.events[rank.pos], not rank.computed, rank.since
        moved = super()._advance(rank, now)
        if fresh:
            self._computing[rank.rank] = now
        began = self._computing.get(rank.rank)
        if began is not None and (moved or rank.work <= replay.EPS):  # this event's compute has ended
            if now - began > replay.EPS:
                self.segments[rank.rank].append(("compute", "compute", ev["step"], began, now))
            self._computing[rank.rank] = None
        if moved and ev["op"] == "wait" and since is not None and now - since > replay.EPS:
            parts = rank.parts.get(ev["of"], ())
            self.segments[rank.rank].append(("wait", _wait_name(parts), ev["step"], since, now))
        return moved


def _wait_name(parts: list) -> str:
    """A replayed wait named as oplog.py names a measured one."""
    if not parts:
        return "comm"
    part = parts[0]
    kind = "bubble" if any(p["op"] == "recv" for p in parts) else "comm"
    site = part.get("site", "")
    if site.startswith("optim.py") or site.endswith(" finish_gradients"):
        return f"{kind} optimizer"
    if site.endswith(" agree"):
        return "bubble agree"  # as train.py clocks it: mostly waiting for the slowest rank
    group = part.get("group") or "world"
    return f"{kind} {group} {part['op']}" if part["op"] in ("send", "recv") else f"{kind} {group}"


def step_segments(run_dir: Path, world: int, rehearse: bool = False) -> Optional[Dict[int, List[tuple]]]:
    """{pp stage: [(kind, name, start, seconds)] of the replay's steady step, from its start}, or
    None where the run dir has no rehearsal (and `rehearse` is not asked)."""
    run_dir = Path(run_dir)
    folder = run_dir / "rehearsal"
    if not rehearse and not any(folder.glob("rank*.json")):
        return None
    from clustermodel import cli
    cfg = cli.run_config(run_dir)
    hw = pm.resolve_hardware(cfg.hardware)
    records = replay.rehearse(cfg, hw, world, folder)
    lay = pm.layout_of(cfg, world)
    cfg = pm.resolve_config(cfg, hw)
    traced = _Traced(records, pm.Rates.of(hw, pm.precision(cfg), lay.gpus), pm.Network(hw, lay),
                     hw.perfmodel.overlap_slowdown or 0.0, replay.host_cost(hw, lay.gpus), replay.core_sharing(hw, lay.gpus),
                     weight=lay.gpus / len(records))
    traced.run()
    out = {}
    for stage, rank in enumerate(replay.stage_ranks(cfg, world)):
        last = max(s for s in traced.ranks[rank].step_ends if isinstance(s, int))
        begin = traced.ranks[rank].step_ends.get(last - 1, 0.0)
        out[stage] = [(kind, name, start - begin, end - start) for kind, name, step, start, end
                      in traced.segments[rank] if step == last]
    return out


def price_stragglers(run_dir: Path, found: list) -> list:
    """diagnosis.json's stragglers (stragglers.from_metrics'), each compute straggler's cost_pct
    re-priced by a what-if replay (replay.what_if) of the run's rehearsal, its own rank rehearsed
    beside its stage's (RUN_DIR/rehearsal/, made here once): `priced_by` "replay", the detector's
    online estimate kept as `excess_pct`. Input and link verdicts, and any the model cannot replay,
    keep the estimate: `priced_by` "excess"."""
    import logging
    from clustermodel import cli
    run_dir = Path(run_dir)
    for verdict in found:
        verdict["priced_by"] = "excess"
    compute = [v for v in found if v["kind"] == "compute" and v["slowdown"] > 1]
    if not compute:
        return found
    try:
        world = json.loads((run_dir / "run.json").read_text())["world_size"]
        cfg = cli.run_config(run_dir)
        hw = _unmeasured(cfg.hardware)  # the detector's rates: a ratio of two replayed steps is the price
        records = replay.rehearse(cfg, hw, world, run_dir / "rehearsal", also=tuple(v["rank"] for v in compute))
        for verdict in compute:
            price = replay.what_if(records, cfg, hw, world, verdict["rank"], verdict["slowdown"])
            verdict.update(excess_pct=verdict["cost_pct"], cost_pct=round(price["cost_pct"], 1), priced_by="replay",
                           replayed={k: round(v, 6) for k, v in price.items()})
    except Exception as e:  # noqa: BLE001 - the online estimate stands; the report says which
        logging.getLogger("predicted").warning("stragglers not replayed (%s: %s): priced by their excess",
                                               type(e).__name__, e)
    return found


def write(run_dir: Path) -> Path:
    """RUN_DIR/observe/predicted.json: {"stages": {pp stage: [[kind, name, start, seconds]]}, "step_s"}
    of the replay of the run's rehearsal (made first where RUN_DIR/rehearsal/ has none)."""
    run_dir = Path(run_dir)
    world = json.loads((run_dir / "run.json").read_text()).get("world_size") if (run_dir / "run.json").exists() \
        else None
    if world is None:
        raise SystemExit(f"{run_dir}/run.json says no world_size: is it a run dir?")
    stages = step_segments(run_dir, world, rehearse=True)
    path = run_dir / "observe" / "predicted.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"stages": {str(s): [list(seg) for seg in segs] for s, segs in stages.items()},
                                "step_s": max((sum(seg[3] for seg in segs) for segs in stages.values()), default=0.0),
                                "rehearsal": str(run_dir / "rehearsal")}))
    return path


def main(argv: Optional[list] = None) -> None:
    import argparse

    from observe import diagnose
    parser = argparse.ArgumentParser(prog="python -m clustermodel.predicted", description="The replay's predicted track beside each "
                                     "rank's measured one: writes RUN_DIR/observe/predicted.json, then the "
                                     "diagnosis, trace and timeline figure with it (python oplog.py RUN_DIR), "
                                     "compute stragglers priced by a what-if replay.")
    parser.add_argument("run_dir", type=Path)
    run_dir = parser.parse_args(argv).run_dir
    print(f"wrote {write(run_dir)}")
    diagnose.main([str(run_dir)], price=price_stragglers)


if __name__ == "__main__":
    main()
