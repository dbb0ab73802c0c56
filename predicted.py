"""What the performance model predicts each rank's step looks like, laid beside what it measured:
the replay (clustermodel/replay.py) of the run's rehearsal, segment by segment.

    python predicted.py RUN_DIR   # RUN_DIR/observe/predicted.json, then python observe.py RUN_DIR with it

The rehearsal is the one `python -m clustermodel validate RUN_DIR` keeps in RUN_DIR/rehearsal/
(each pipeline stage's first rank, its collectives, sends, receives and waits stamped with the
compute between them), made here when it is not there (a few seconds for a small model: one rank
per stage on the meta device). A rehearse.record=true run's own record (RUN_DIR/comm/) is not
used: a real run's record carries no compute to price.

The replay runs the rehearsed steps once; its last (steady) step, from the end of the one before,
is what predicted.json keeps per pipeline stage: compute between operations as "compute", each
wait named as the measured waits are ("comm tp", "bubble pp recv", ...). observe.py lays it at the
start of each step a rank measured (timeline.lay_predicted); ranks of one stage share their
stage's program. This is apart from observe.py because the cluster model imports the config,
which imports observe.py."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

from clustermodel import perfmodel as pm
from clustermodel import replay


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
    """A replayed wait named as observe.py names a measured one."""
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


def run_config(run_dir: Path):
    """The run's config (its .hydra/config.yaml), on the hardware its replay prices it on: its own,
    or this CPU's calibration (hardware=cpu_local) where it left the machine to `auto`."""
    from omegaconf import OmegaConf

    import config
    from clustermodel import cli
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(config.Config),
                                              OmegaConf.load(Path(run_dir) / ".hydra" / "config.yaml")))
    if cfg.hardware.name == "auto":
        cfg.hardware = cli.compose(["hardware=cpu_local"]).hardware
    return cfg


def step_segments(run_dir: Path, world: int, rehearse: bool = False) -> Optional[Dict[int, List[tuple]]]:
    """{pp stage: [(kind, name, start, seconds)] of the replay's steady step, from its start}, or
    None where the run dir has no rehearsal (and `rehearse` is not asked)."""
    run_dir = Path(run_dir)
    folder = run_dir / "rehearsal"
    if not rehearse and not any(folder.glob("rank*.json")):
        return None
    cfg = run_config(run_dir)
    hw = pm.resolve_hardware(cfg.hardware)
    records = replay.rehearse(cfg, hw, world, folder)
    lay = pm.layout_of(cfg, world)
    cfg = pm.resolve_config(cfg, hw)
    traced = _Traced(records, pm.Rates.of(hw, pm.precision(cfg), lay.gpus), pm.Network(hw, lay),
                     hw.overlap_slowdown or 0.0, replay.host_cost(hw, lay.gpus), replay.core_sharing(hw, lay.gpus),
                     weight=lay.gpus / len(records))
    traced.run()
    out = {}
    for stage, rank in enumerate(replay.stage_ranks(cfg, world)):
        last = max(s for s in traced.ranks[rank].step_ends if isinstance(s, int))
        begin = traced.ranks[rank].step_ends.get(last - 1, 0.0)
        out[stage] = [(kind, name, start - begin, end - start) for kind, name, step, start, end
                      in traced.segments[rank] if step == last]
    return out


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

    import observe
    parser = argparse.ArgumentParser(prog="predicted.py", description="The replay's predicted track beside each "
                                     "rank's measured one: writes RUN_DIR/observe/predicted.json, then the "
                                     "diagnosis, trace and timeline figure with it (python observe.py RUN_DIR).")
    parser.add_argument("run_dir", type=Path)
    run_dir = parser.parse_args(argv).run_dir
    print(f"wrote {write(run_dir)}")
    observe.main([str(run_dir)])


if __name__ == "__main__":
    main()
