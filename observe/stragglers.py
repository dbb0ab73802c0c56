"""Stragglers named as culprits, not victims (MegaScale section 5; the score is nvidia-resiliency-ext's
fastest-over-own, on window medians).

Every step a rank times its own work: compute is its forward and backward less every wait in them
(overlap.WaitClock's: TP, PP, DP), the optimizer left out (the same work on every rank of a group,
it only dilutes a slowdown; on CUDA, where the host's clock sees launches, not kernels, it is
WaitClock's compute, the stream's span less its waits, optimizer included); input is the data
loader's time; wait is the time blocked on the dp group's own collectives (what a slow link
lengthens; group_wait: oplog.py labels each wait by its op's mesh dimension, so TP's waits on a
host's loopback do not blur the floor of a DP link across hosts). Every ft.straggler_interval
steps (a window) it keeps the median of each over the window, so a one-step spike moves nothing.

Who is compared with whom: where a dp group has other members, only ranks that do the same work,
the dp group of a (pp, tp) coordinate (the same stage, the same slice): their predicted work is
identical, so the performance model's prediction, and its error, would cancel. Where the dp group
is the rank alone (dp=1), its compute over what the model predicts for its stage
(train.predicted_stage_compute, once at start-up: the last stage's head and loss, the first's
embedding) is compared with the job's. The heat map of `python -m observe RUN_DIR` divides by
the same prediction.

Scores, computed on the device from the group's gathered figures (no host read):
- compute, input: slowdown = own median / the group's reference, the first quartile of its members'
  medians (the faster of two). A compute culprit also arrives late: its wait is at most the group's
  median wait, while its victims wait for it; a rank that waits longer than that is not a culprit.
- compute, a group of one rank: slowdown = own median / (its stage's prediction x the job's first
  quartile of compute over prediction), late where its idle time (the step less compute and input:
  pipeline receives included) is at most the job's median; both from a world histogram (one
  all-reduce SUM of 2 x BINS int32, log-spaced bins), read on the device.
- link: a group's transfer floor is the least wait among its members (the member that
  arrives last waits for the transfer alone), compared with the floors of the stage's other groups
  (other tp coordinates: the same collectives). A group (one whose members compute normally, where
  the waits are all comm waits, not the group's own: group_scores' dp_waits) whose
  floor is LINK_FACTOR times the stage's lowest, costing more than the threshold of the step, has a
  slow link; one group cannot tell which of its members' links is slow, so the verdict names its
  lowest rank and lists its ranks.

Cost per window and rank: one all-gather of FIGURES floats over its dp group and one all-reduce
(MAX) of 2 + 2 * pp int64 over the world (the culprit of each kind packed with its score and
excess; each stage's highest and, negated, lowest link floor); with dp=1, the histogram's
all-reduce first (16 KiB at any world size). All take device tensors; the result
is read on the host one window later, when the collectives have long completed. A verdict
needs ft.straggler_windows windows over 1 + ft.straggler_threshold among the last that many plus
one (one noisy window does not reset it; a one-step spike moves no median), and an excess of at
least a quarter of the threshold of the step (a ratio of two tiny times is noise); with the
defaults (20-step windows, 3 of 4, read one window late) it comes within 100 steps of a
slowdown's start. One culprit per kind a window: the worst (the MAX).
Priced online: the step time without the culprit's slowness is the measured step less its excess
(own median less the reference: a synchronous step waits for all of it); cost_pct is that excess
over the measured step. Offline, `python -m clustermodel.predicted RUN_DIR` re-prices compute
stragglers by a what-if replay (clustermodel.predicted.price_stragglers), which sees what a
pipeline absorbs.

The performance model's per-stage compute (clustermodel.predicted.stage_compute_s) comes in as
`stage_s`, computed by train.py at start-up, and is written beside each window's figures: this
module imports nothing of the cluster model, which imports the config, which imports observe/heartbeat.py,
whose diagnosis reads this module.
"""
from __future__ import annotations

import collections
import contextlib
import json
import logging
import socket
import statistics
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

log = logging.getLogger("stragglers")

KINDS = ("compute", "input", "link")
FIGURES = 4  # per rank and window: compute, input, comm wait, step (seconds, medians)
SCORE_BITS, EXCESS_BITS, RANK_BITS = 20, 20, 20  # the packed culprit: score in 1/1000, excess in ms, rank
LOW = torch.iinfo(torch.int64).min  # no contribution to the MAX
LINK_FACTOR = 2.0  # a link verdict: a group's transfer floor this many times its stage's lowest
# The world's histogram of normalised compute and of idle time (a dp group of one rank): log2 bins of
# 1/64 octave (1.1%) from 2^-16 to 2^16, 16 KiB of int32 per rank and window at any world size
BINS_PER_OCTAVE, LOG2_LOW, BINS = 64, -16, 64 * 32


def pack(score: torch.Tensor, excess_s: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """(score, excess, rank) as one int64 whose MAX over ranks is the highest score's (on the device)."""
    top = 2 ** SCORE_BITS - 1
    s = (score * 1000).round().clamp(0, top).long()
    e = (excess_s * 1000).round().clamp(0, 2 ** EXCESS_BITS - 1).long()
    return (s << (EXCESS_BITS + RANK_BITS)) | (e << RANK_BITS) | rank.long()


def unpack(value: int) -> tuple:
    """pack's (score, excess seconds, rank)."""
    return ((value >> (EXCESS_BITS + RANK_BITS)) / 1000, ((value >> RANK_BITS) & (2 ** EXCESS_BITS - 1)) / 1000,
            value & (2 ** RANK_BITS - 1))


def bins(x: torch.Tensor) -> torch.Tensor:
    """The histogram bin of positive figures x: log2-spaced, BINS_PER_OCTAVE an octave from 2^LOG2_LOW."""
    return ((x.clamp_min(1e-30).log2() - LOG2_LOW) * BINS_PER_OCTAVE).floor().clamp(0, BINS - 1).long()


def world_histogram(normalised: torch.Tensor, idle: torch.Tensor) -> torch.Tensor:
    """This rank's [2, BINS] int32 counts (a one in its bin of each row): its compute over its
    stage's prediction, and its idle time; summed over the world, the job's distributions."""
    out = torch.zeros(2, BINS, dtype=torch.int32, device=normalised.device)
    out[0, bins(normalised)] = 1
    out[1, bins(idle)] = 1
    return out


def world_reference(histogram: torch.Tensor) -> tuple:
    """From the world's summed histogram: (the first quartile of normalised compute, as a figure;
    the lower median's bin of idle time), on the device, as group_scores takes them."""
    def kth(row, k):  # the bin of the k-th smallest (0-based)
        return torch.searchsorted(row.cumsum(0), (k + 1).to(torch.int64).unsqueeze(0), right=False)[0]
    n = histogram[0].sum().to(torch.int64)
    quartile = kth(histogram[0].to(torch.int64), (n - 1) // 4)
    return 2.0 ** ((quartile.double() + 0.5) / BINS_PER_OCTAVE + LOG2_LOW), kth(histogram[1].to(torch.int64), (n - 1) // 2)


def group_scores(figures: torch.Tensor, ranks: torch.Tensor, me: int, threshold: float, pp: int,
                 pp_rank: int, dp_waits: bool = False, world: Optional[tuple] = None) -> torch.Tensor:
    """This rank's contribution to the world's MAX, from its dp group's gathered figures [G, FIGURES]:
    [compute culprit, input culprit, then per stage (link floor, -link floor)], packed. Every member
    computes the same group figures; only the group's lowest rank contributes the link floor.
    dp_waits: the waits are the group's own collectives' (group_wait). Then the floor is the last
    arriver's transfer whatever its members compute, and a group reports it even with a compute
    straggler or noise in it; with all comm waits (TP's, PP's too) only a group computing normally
    does (a straggler's TP peers wait for it, and would raise their group's floor).
    world: (this stage's predicted compute, world_reference's quartile and idle median) where the
    group is one rank: its compute is then scored on the job's normalised figures."""
    compute, data, wait, step = figures.unbind(1)
    k = max((len(compute) - 1) // 4, 0)  # the first quartile: the faster of 2, the fastest of up to 4
    ref = lambda x: x.sort().values[k].clamp_min(1e-9)
    if world is None:
        late, reference = wait[me] <= wait.median(), ref(compute)
    else:  # late: it idles (waits on its peers, of any kind) no longer than the job's median rank
        predicted, quartile, idle_median = world
        late = bins(step[me] - compute[me] - data[me]) <= idle_median
        reference = (quartile * predicted).clamp_min(1e-9)  # what its stage takes at the reference's speed
    c_score = torch.where(late, compute[me] / reference, torch.ones_like(compute[me]))
    i_score = data[me] / ref(data)
    rank = ranks[me]
    out = torch.full((2 + 2 * pp,), LOW, dtype=torch.int64, device=figures.device)
    out[0] = pack(c_score, compute[me] - reference, rank)
    out[1] = pack(i_score, data[me] - ref(data), rank)
    normal = (compute / ref(compute)).max() <= 1 + threshold
    normal = normal | dp_waits
    if me == 0:  # the group's link floor, where every member computes normally (else none)
        floor = wait.min()
        top, least = pack(floor, floor, ranks.min()), -(floor * 1e6).round().long()  # negated us: MAX is the least
        out[2 + 2 * pp_rank] = torch.where(normal, top, out[2 + 2 * pp_rank])
        out[3 + 2 * pp_rank] = torch.where(normal, least, out[3 + 2 * pp_rank])
    return out


def group_wait(timing: dict, labelled: bool) -> float:
    """The step's wait in the dp group's own collectives (WaitClock's waits labelled "comm dp"): the
    transfers the group's members are compared on. TP's waits on a host's loopback and PP's on other
    links are no part of the group's transfer floor. All comm waits where the clock does not label
    its waits (labelled False: observe.spans=0)."""
    if not labelled:
        return timing["comm_s"]
    return sum(s for label, s in timing.get("waits", {}).items() if label == "comm dp")


class Detector:
    """This rank's window of per-step figures, its group's comparison, and (on every rank, logged
    by rank 0) the verdicts that persist."""

    def __init__(self, layout, interval: int, threshold: float, windows: int, device: torch.device,
                 run_dir: Optional[Path] = None, stage_s: Optional[list] = None):
        self.layout, self.interval, self.threshold, self.windows = layout, interval, threshold, windows
        self.device, self.rank, self.clock = device, layout.rank, layout.clock
        self.group = layout.group("dp") if layout.world > 1 and layout.dp > 1 else None
        # a group of one rank (dp=1): its compute over its stage's predicted (stage_s: the model's
        # compute a step per stage) is compared with the job's (a world histogram); none without figures
        self.stage_predicted = stage_s[layout.pp_rank] if stage_s else None  # written with the figures
        self.predicted = self.stage_predicted if layout.world > 1 and layout.dp == 1 else None
        self.members = dist.get_process_group_ranks(self.group) if self.group is not None else [layout.rank]
        self.me = self.members.index(layout.rank)
        self.rows: list = []       # (compute, input, wait, step) of each step of the window
        self.pending = None        # the reduced tensor of the last window, read at the next
        # the suspects ((kind, rank)) of the last windows + 1 windows: a verdict needs `windows` of them
        self.recent = collections.deque(maxlen=windows + 1)
        self.verdicts: dict = {}   # (kind, rank) -> its verdict, as first confirmed then updated
        self.figures_dir = Path(run_dir) / "observe" / "stragglers" if run_dir is not None else None
        self.compute_s = 0.0       # this step's compute, less its waits (timed())

    @contextlib.contextmanager
    def timed(self, backward: bool, action=None):
        """The hook around each unit of compute (ParallelModel.around_compute: the forward and
        backward, or each pipeline action): its own time, less the waits the rank's
        overlap.WaitClock timed, added to this step's compute; an evaluation's (backward=False) is
        not training's."""
        waited, t0 = sum(self.clock.seconds.values()), time.perf_counter()
        yield
        if backward:
            self.compute_s += time.perf_counter() - t0 - (sum(self.clock.seconds.values()) - waited)

    def step(self, step: int, timing: dict, data_s: float) -> list:
        """Add one step's figures; at a window's end, compare and return the verdicts confirmed or
        updated by the previous window's result (a list of dicts; empty between windows)."""
        compute = timing["compute_s"] if self.device.type == "cuda" else self.compute_s
        wait = group_wait(timing, labelled=self.clock.describe is not None)
        self.rows.append((max(compute, 0.0), data_s, wait, timing["step_s"]))
        self.compute_s = 0.0
        if step % self.interval:
            return []
        out = self._read(step) if self.pending is not None else []
        medians = [statistics.median(col) for col in zip(*self.rows)]
        self.rows = []
        self._write_figures(step, medians)
        mine = torch.tensor(medians, dtype=torch.float64, device=self.device)
        if self.group is not None:
            gathered = torch.empty(len(self.members) * FIGURES, dtype=torch.float64, device=self.device)
            dist.all_gather_single(gathered, mine, group=self.group)
        else:
            gathered = mine
        ranks = torch.tensor(self.members, device=self.device)
        world = None
        if self.predicted is not None:  # one all-reduce of a fixed size, no host read
            histogram = world_histogram(mine[0] / self.predicted, (mine[3] - mine[0] - mine[1]).clamp_min(0))
            dist.all_reduce(histogram)
            world = (self.predicted, *world_reference(histogram))
        reduced = group_scores(gathered.view(-1, FIGURES), ranks, self.me, self.threshold, self.layout.pp,
                               self.layout.pp_rank, dp_waits=self.clock.describe is not None, world=world)
        if self.layout.world > 1:
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
        self.pending = (reduced, medians[3])
        return out

    def _read(self, step: int) -> list:
        reduced, step_s = self.pending
        values = reduced.tolist()  # issued a window ago: long complete, no wait
        found = {}
        for kind, value in zip(("compute", "input"), values[:2]):
            score, excess, rank = unpack(value)
            if score > 1 + self.threshold:
                found[(kind, rank)] = (score, excess)
        for s in range(self.layout.pp):
            top, least = values[2 + 2 * s], -values[3 + 2 * s]
            if top < 0 or values[3 + 2 * s] == LOW:  # no group of that stage computed normally
                continue
            floor, _, rank = unpack(top)
            least_s = least / 1e6
            if floor > LINK_FACTOR * least_s and floor - least_s > self.threshold * step_s:
                found[("link", rank)] = (floor / max(least_s, 1e-9), floor - least_s)
        self.recent.append(set(found))
        log.debug("window before step %d: %s; suspects %s", step,
                  [unpack(v) if v >= 0 else None for v in values], found)
        out = []
        for key, (slowdown, excess) in found.items():
            # and costs something: a quarter of the threshold of the step (a ratio of two tiny times is noise)
            persisted = sum(key in seen for seen in self.recent)
            if persisted >= self.windows and excess >= self.threshold / 4 * step_s:
                kind, rank = key
                verdict = {"rank": rank, "kind": kind, "slowdown": round(slowdown, 3),
                           "cost_pct": round(100 * excess / step_s, 1) if step_s > 0 else 0.0,
                           "step": step, "first_step": self.verdicts.get(key, {}).get("first_step", step)}
                if kind == "link":
                    verdict["ranks"] = self._group_of(rank)
                self.verdicts[key] = verdict
                out.append(verdict)
        return out

    def _group_of(self, rank: int) -> list:
        """The ranks of the dp group whose lowest rank is `rank` (the mesh's layout: run.json's)."""
        if self.layout.mesh is None:
            return [rank]
        mesh = self.layout.mesh.mesh
        dp_dim = self.layout.mesh.mesh_dim_names.index("dp")
        rows = mesh.movedim(dp_dim, -1).reshape(-1, mesh.shape[dp_dim]).tolist()
        return next((r for r in rows if min(r) == rank), [rank])

    def _write_figures(self, step: int, medians: list) -> None:
        """This rank's window medians, appended to its own file (a line a window), for the heat map."""
        if self.figures_dir is None:
            return
        self.figures_dir.mkdir(parents=True, exist_ok=True)
        with open(self.figures_dir / f"rank{self.rank}.jsonl", "a") as f:
            f.write(json.dumps({"rank": self.rank, "host": socket.gethostname(), "step": step,
                                "coords": self.layout.coordinates(), "predicted_s": self.stage_predicted,
                                **dict(zip(("compute_s", "input_s", "wait_s", "step_s"), medians))}) + "\n")


def figures(run_dir: Path) -> dict:
    """{rank: [its window medians, oldest first]} from observe/stragglers/rank<K>.jsonl."""
    out = {}
    for path in (Path(run_dir) / "observe" / "stragglers").glob("rank*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if rows:
            out[rows[0]["rank"]] = rows
    return out


def log_verdicts(verdicts: list, step: int) -> dict:
    """Log each verdict (rank 0: a warning when first confirmed, then its updates) and return the
    metrics row's fields for them."""
    for v in verdicts:
        log.log(logging.WARNING if v["step"] == v["first_step"] else logging.INFO,
                "straggler at step %d: rank %d, %s, %.2fx its peers, costs %.1f%% of the step%s", step,
                v["rank"], v["kind"], v["slowdown"], v["cost_pct"],
                f" (its dp group: ranks {v['ranks']})" if "ranks" in v else "")
    if not verdicts:
        return {}
    row = {"stragglers": len(verdicts), "straggler_verdicts": verdicts,  # metrics.jsonl's list
           "straggler_max_slowdown": max(v["slowdown"] for v in verdicts)}
    for v in verdicts:  # W&B's scalars (it logs no list of records)
        row[f"straggler/{v['kind']}/rank{v['rank']}/slowdown"] = v["slowdown"]
        row[f"straggler/{v['kind']}/rank{v['rank']}/cost_pct"] = v["cost_pct"]
    return row


# --- Offline: the diagnosis's list and the heat map ---

def from_metrics(run_dir: Path, late: Optional[dict] = None) -> list:
    """diagnosis.json's `stragglers`: the last verdict of each (rank, kind) in metrics.jsonl, with
    how late its rank posted its collectives (`late`: post_lateness's) where known."""
    path = Path(run_dir) / "metrics.jsonl"
    last = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            for v in row.get("straggler_verdicts", []):
                last[(v["rank"], v["kind"])] = v
    for v in last.values():
        if late and v["rank"] in late:
            v["post_late_ms"] = late[v["rank"]]
    return [last[k] for k in sorted(last)]


def post_lateness(snaps: dict, offsets: dict) -> dict:
    """{rank: ms, per step, that it posted its collectives after the first member posted them:
    summed over the step's collectives in its op log's ring that another member's ring holds too,
    the median over steps (a one-step spike moves nothing)}, clocks aligned (timeline.clock_offsets).
    A culprit posts late, its victims early and wait; a step's first collective that waits for every
    member (a DP reduction) puts the ranks back in step, so it is the sum that tells them apart."""
    from observe.timeline import GROUP, OP, PEER, POST, SEQ, STEP
    posts: dict = {}  # (group, seq) -> {rank: (aligned post time, step)}
    for rank, snap in snaps.items():
        for e in snap["ops"]:
            if e[PEER] is None and not e[OP].startswith("skipped") and rank in offsets:
                posts.setdefault((e[GROUP], e[SEQ]), {})[rank] = (e[POST] - offsets[rank], e[STEP])
    late = collections.defaultdict(lambda: collections.defaultdict(float))  # rank -> step -> seconds
    for by_rank in posts.values():
        if len(by_rank) > 1:
            first = min(t for t, _ in by_rank.values())
            for rank, (t, step) in by_rank.items():
                late[rank][step] += t - first
    return {r: round(1e3 * statistics.median(late[r].values()), 3) for r in sorted(late)}


def stage_predictions(run_dir: Path) -> Optional[dict]:
    """{pp stage: the performance model's compute a step} as the run's detector divided by (written
    with each window's figures); None where the run had none."""
    found = {rows[-1]["coords"]["pp"]: rows[-1].get("predicted_s") for rows in figures(run_dir).values()}
    return found if found and all(v for v in found.values()) else None


def heat_map(run_dir: Path, out: Path) -> Optional[Path]:
    """A figure: ranks laid out dp x (pp, tp), one panel per kind, colour = measured / predicted
    (compute: over its stage's predicted compute, stage_predictions', scaled to the job's median
    rank; input and wait: over the median of the ranks of the same stage, which the model predicts
    alike), each rank's last window. None without figures."""
    ranks = [rows[-1] for _, rows in sorted(figures(run_dir).items())]  # each rank's last window
    if not ranks:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    work = stage_predictions(run_dir) or {s: 1.0 for s in range(1 + max(r["coords"]["pp"] for r in ranks))}
    per_work = statistics.median(r["compute_s"] / work[r["coords"]["pp"]] for r in ranks) or 1e-9
    dp = 1 + max(r["coords"]["dp"] for r in ranks)
    pp = 1 + max(r["coords"]["pp"] for r in ranks)
    tp = 1 + max(r["coords"]["tp"] for r in ranks)
    panels = {"compute": lambda r: r["compute_s"] / (per_work * work[r["coords"]["pp"]])}
    for key, name in (("input_s", "input"), ("wait_s", "comm wait")):  # (a culprit's victims wait long)
        med = {s: statistics.median(x[key] for x in ranks if x["coords"]["pp"] == s) or 1e-9 for s in range(pp)}
        panels[name] = lambda r, key=key, med=med: r[key] / med[r["coords"]["pp"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 1 + 0.5 * dp), squeeze=False)
    for ax, (name, ratio) in zip(axes[0], panels.items()):
        grid = [[float("nan")] * (pp * tp) for _ in range(dp)]
        for r in ranks:
            c = r["coords"]
            grid[c["dp"]][c["pp"] * tp + c["tp"]] = ratio(r)
        image = ax.imshow(grid, cmap="coolwarm", vmin=0.5, vmax=1.5, aspect="auto")
        ax.set_title(f"{name}: measured / predicted")
        ax.set_xticks(range(pp * tp), [f"pp{s} tp{t}" for s in range(pp) for t in range(tp)], fontsize=7)
        ax.set_yticks(range(dp), [f"dp{d}" for d in range(dp)], fontsize=7)
        for r in ranks:
            c = r["coords"]
            ax.text(c["pp"] * tp + c["tp"], c["dp"], str(r["rank"]), ha="center", va="center", fontsize=7)
        fig.colorbar(image, ax=ax)
    fig.tight_layout()
    path = Path(out) / "heatmap.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
