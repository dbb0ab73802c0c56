"""The paper's tables from our own runs: MegaScale Table 3 (the ablation), Table 2 (strong scaling)
and the convergence comparison. Markdown on stdout; LaTeX (.tex) and CSV (raw numbers) files beside.

    python experiments/tables.py multirun/2025-01-01/12-00-00 [more dirs] [--out DIR]
    python experiments/tables.py --wandb-group G [--wandb-project P] --out DIR

A dir is a Hydra multirun dir (jobs 0/, 1/, ... each with run.json and metrics.jsonl) or one job's
dir. run.json is the source of truth: study {name, step, label, scale, fabric}, status, final,
world_size, config. Runs are grouped by study, then by (scale, fabric): one table per group, and the
fabric is in its title, because MFU measured over loopback and over an emulated network don't compare.

- Ablation: step, MFU, ΔMFU, tokens/s, step time, exposed comm. ΔMFU is in MFU points against the
  previous step that has a measurement; "(vs X)" says which when the steps in between have none.
  An expected step with no run shows "missing"; a failed or pending run shows its status. Neither
  is ever a zero, and neither is a ΔMFU baseline.
- Strong scaling: GPUs, batch, step time, tokens/s, MFU, scaling efficiency, where (as for MegaScale
  Table 2) scaling efficiency = (tokens/s / GPUs) / (tokens/s / GPUs of the run with the fewest GPUs
  at the same batch, in the same group, among those with a measurement). 100% is perfect strong scaling.
- Convergence: variant, tokens seen (steps * batch * seq_len), final loss, val loss.

Files are out/<study>.csv and out/<study>.tex (out defaults to the first dir). An existing one is
never overwritten: the command refuses with one line and exit code 2, and writes nothing.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from config import ABLATION_LABELS  # noqa: E402
from experiments import intervals, switches  # noqa: E402
from metrics import markdown_table, pct, seconds  # noqa: E402

STUDIES = ("megascale_ablation", "strong_scaling", "convergence")
# train.py's RunLog has written "finished"/"interrupted"; the study schema says "ok"/"stopped".
STATUS_ALIASES = {"finished": "ok", "interrupted": "stopped"}
# Which run wins when a step was run more than once: a measurement beats any status, then the newest.
STATUS_RANK = {"ok": 0, "stopped": 1, "running": 2, "pending": 3, "failed": 4}


class SourceError(Exception):
    """A problem with what we were asked to read or write: one line for the user, exit code 2."""




def count(x: Optional[float]) -> str:
    if x is None:
        return "n/a"
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.3g}{unit}"
    return f"{x:.0f}"


# --- Runs ---

@dataclass
class Run:
    """One training job as the tables see it."""
    dir: str
    study: Optional[str]
    step: Optional[int]
    label: str
    scale: str
    fabric: str
    status: str           # ok | stopped | running | pending | failed
    final: dict = field(default_factory=dict)
    world: Optional[int] = None
    batch: Optional[int] = None
    seq_len: Optional[int] = None
    started: str = ""     # the last attempt's start time: the newest of duplicate runs wins
    without: List[int] = field(default_factory=list)  # earlier ablation steps this row lacks (pending)
    config: dict = field(default_factory=dict)   # run.json's resolved config
    layout: dict = field(default_factory=dict)   # run.json's layout as built (sizes, every rank's coordinates)
    backends: dict = field(default_factory=dict)  # run.json's: attention backend, precision, TF32, compiled

    @property
    def measured(self) -> bool:
        """Has numbers to show. A stopped run's are real, over fewer steps (its row says so)."""
        return self.status in ("ok", "stopped") and "loss" in self.final

    @property
    def tokens(self) -> Optional[int]:
        if None in (self.batch, self.seq_len) or "steps" not in self.final:
            return None
        return self.final["steps"] * self.batch * self.seq_len


def job_dirs(root: Path) -> List[Path]:
    """A multirun dir's jobs (root/0, root/1, ...), or root itself when it is one job's dir."""
    if not root.is_dir():
        raise SourceError(f"{root}: no such directory. Fix: give a Hydra multirun dir or a run dir")
    if (root / "run.json").exists() or (root / ".hydra").is_dir():
        return [root]
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def read_job(job: Path) -> Run:
    path = job / "run.json"
    if path.exists():
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError as err:  # train.py writes it atomically, so this is a hand edit or a bad copy
            raise SourceError(f"{path}: not JSON ({err}). Fix: restore it, or leave its dir out") from None
        status = record.get("status") or "running"
        return run_from_record(record, STATUS_ALIASES.get(status, status), str(job))
    # No run.json: the job died before train.py started logging (a config error, say). Hydra's
    # config still says which study row it was.
    return run_from_record({"config": _hydra_config(job)}, "failed", str(job))


def _hydra_config(job: Path) -> dict:
    path = job / ".hydra" / "config.yaml"
    if not path.exists():
        return {}
    from omegaconf import OmegaConf
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def run_from_record(record: dict, status: str, where: str) -> Run:
    cfg = record.get("config") or {}
    study = record.get("study") or cfg.get("study") or {}
    train = cfg.get("train") or {}
    label = study.get("label") or ""
    attempts = record.get("attempts") or [{}]
    return Run(dir=where, study=study.get("name"), step=study.get("step"), label=label,
               scale=study.get("scale") or "unknown", fabric=study.get("fabric") or "unknown", status=status,
               final=record.get("final") or {}, world=record.get("world_size") or _gpus_in(label),
               batch=train.get("batch_size"), seq_len=train.get("seq_len"), started=attempts[-1].get("started", ""),
               without=list(study.get("without") or []), config=cfg, layout=record.get("layout") or {},
               backends=record.get("backends") or {})


def _gpus_in(label: str) -> Optional[int]:
    """A job that died before writing run.json has no world size; a scaling label says it ("gpus=8 ...")."""
    found = re.search(r"gpus=(\d+)", label)
    return int(found.group(1)) if found else None


def read_metrics(run_dir) -> List[dict]:
    """metrics.jsonl rows by step. A resumed run logs the steps after its checkpoint again (the last
    write wins). A line that does not parse (a crash's partial last line, a bad copy) is skipped,
    and said on stderr: the table or figure is drawn from the rest."""
    path = Path(run_dir) / "metrics.jsonl"
    rows, bad = {}, []
    for number, line in enumerate(path.read_text(errors="replace").splitlines() if path.exists() else [], 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad.append(number)
            continue
        if isinstance(row, dict):
            rows[row.get("step")] = row
    if bad:
        print(f"{path}: skipped {len(bad)} unreadable line(s) ({', '.join(map(str, bad[:5]))})", file=sys.stderr)
    return [rows[k] for k in sorted(k for k in rows if isinstance(k, int))]


def status_counts(runs: Sequence[Run]) -> str:
    counts: Dict[str, int] = {}
    for run in runs:
        counts[run.status] = counts.get(run.status, 0) + 1
    return ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))


def load_runs(dirs: Iterable) -> List[Run]:
    runs = []
    for root in map(Path, dirs):
        jobs = job_dirs(root)
        if not jobs:
            raise SourceError(f"{root}: no job dirs (0/, 1/, ...) and no run.json. "
                              f"Fix: give a Hydra multirun or run dir")
        runs += [read_job(job) for job in jobs]
    return runs


def load_wandb_group(group: str, project: str) -> List[Run]:
    """Runs of a W&B group, through the public API (online only). W&B's config is train.py's config,
    study included; its summary holds the final metrics. W&B cannot tell a run that finished from
    one train.py stopped cleanly (both are "finished" there), and has no world size: that comes from
    the parallel config when dp is explicit. A run W&B calls killed never wrote its final medians."""
    mode = os.environ.get("WANDB_MODE", "")
    if mode in ("offline", "disabled", "dryrun"):
        raise SourceError(f"--wandb-group needs W&B online, and WANDB_MODE={mode}. Fix: read the multirun dirs instead")
    try:
        import wandb
        found = list(wandb.Api(timeout=30).runs(project, filters={"group": group}))
    except Exception as err:  # no key, no network, no such project: all one line
        reason = (str(err) or type(err).__name__).splitlines()[0][:200].rstrip(".")
        raise SourceError(f"W&B group {group!r} in {project!r} unreadable: {reason}. "
                          f"Fix: wandb login and go online, or read the multirun dirs") from None
    return [_run_from_wandb(r) for r in found]


def _run_from_wandb(r) -> Run:
    status = {"finished": "ok", "killed": "failed", "crashed": "failed", "failed": "failed"}.get(r.state, r.state)
    record = {"config": dict(r.config), "final": dict(r.summary), "attempts": [{"started": str(r.created_at)}]}
    p = record["config"].get("parallel") or {}
    if (p.get("dp") or -1) > 0:
        record["world_size"] = p["dp"] * p.get("tp", 1) * p.get("pp", 1)
    return run_from_record(record, status, f"wandb:{'/'.join(r.path)}")


# --- Tables ---

@dataclass
class Table:
    title: str
    headers: List[str]
    cells: List[List[str]]      # formatted, for Markdown and LaTeX
    records: List[dict]         # raw numbers, for the CSV
    notes: List[str] = field(default_factory=list)

    def markdown(self) -> str:
        return "\n\n".join([self.title, markdown_table(self.headers, self.cells)] + self.notes)

    def latex(self) -> str:
        lines = [r"\begin{table}[t]", r"\centering", rf"\caption{{{latex_escape(self.title)}}}",
                 rf"\begin{{tabular}}{{l{'r' * (len(self.headers) - 1)}}}", r"\toprule",
                 " & ".join(map(latex_escape, self.headers)) + r" \\", r"\midrule"]
        lines += [" & ".join(latex_escape(str(c)) for c in row) + r" \\" for row in self.cells]
        lines += [r"\bottomrule", r"\end{tabular}"]
        lines += [rf"\par\smallskip{{\footnotesize {latex_escape(n)}}}" for n in self.notes]
        return "\n".join(lines + [r"\end{table}"])


def latex_escape(text: str) -> str:
    text = text.replace("\\", r"\textbackslash{}")
    for char in "&%$#_{}":
        text = text.replace(char, "\\" + char)
    return text.replace("~", r"\textasciitilde{}").replace("^", r"\^{}").replace("Δ", r"$\Delta$")


def groups(runs: Sequence[Run], study: str) -> Dict[Tuple[str, str], List[Run]]:
    """A study's runs by (scale, fabric), in the order first seen."""
    out: Dict[Tuple[str, str], List[Run]] = {}
    for run in runs:
        if run.study == study:
            out.setdefault((run.scale, run.fabric), []).append(run)
    return out


def _title(name: str, key: Tuple[str, str], statuses: List[str]) -> str:
    tally = ", ".join(f"{statuses.count(s)} {s}" for s in dict.fromkeys(statuses))
    return f"{name}: scale {key[0]}, fabric {key[1]} ({tally})"


def _empty(status: str) -> str:
    """The word in a row's first metric cell when it has no numbers."""
    return "no data" if status in ("ok", "stopped") else status


def _name(text: str, run: Optional[Run]) -> str:
    """A row's label, with what makes its numbers not the plain step: a stopped run, or a
    cumulative step run without earlier steps that are still pending."""
    if run is not None and run.without:
        text += f" (without step{'s' if len(run.without) > 1 else ''} {', '.join(map(str, run.without))})"
    return text + (" (stopped)" if run is not None and run.status == "stopped" and run.measured else "")


def describe_backends(ran: dict) -> str:
    """run.json's backends in a few words: "attention sdpa (SDPA flash_attention), bf16, TF32 off, eager"."""
    if not ran:
        return "not recorded"
    attention = ran.get("attention") or {}
    text = f"attention {attention.get('ran', '?')}"
    text += f" (SDPA {attention['sdpa_kernel']})" if attention.get("sdpa_kernel") else ""
    text += f" (auto without flash-attn: {attention['fallback']})" if attention.get("fallback") else ""
    tf32 = {True: "TF32 on", False: "TF32 off"}.get(ran.get("tf32"), "TF32 n/a")
    return f"{text}, {ran.get('precision', '?')}, {tf32}, {'compiled' if ran.get('compiled') else 'eager'}"


def backends_note(rows: Sequence[Tuple[str, Optional[Run]]]) -> List[str]:
    """The note under a table naming what computed its measured rows, rows alike grouped."""
    alike: Dict[str, List[str]] = {}
    for name, run in rows:
        if run is not None and run.measured:
            alike.setdefault(describe_backends(run.backends), []).append(name)
    if len(alike) == 1:
        return [f"Ran (every measured row): {next(iter(alike))}."]
    return ["Ran: " + "; ".join(f"{', '.join(names)}: {what}" for what, names in alike.items()) + "."] if alike else []


def best_per_step(runs: List[Run]) -> Dict[object, Run]:
    """One run per ablation step (or per label, without a step): a measurement beats any other
    status, then the newest attempt wins (a rerun after a fix)."""
    best: Dict[object, Run] = {}
    for run in sorted(runs, key=lambda r: r.started):  # ISO timestamps sort as strings: newest last
        key = run.step if run.step is not None else run.label
        if key not in best or STATUS_RANK.get(run.status, 9) <= STATUS_RANK.get(best[key].status, 9):
            best[key] = run
    return best


def ablation(runs: Sequence[Run]) -> List[Table]:
    return [_ablation_group(key, group) for key, group in groups(runs, "megascale_ablation").items()]


def _ablation_group(key: Tuple[str, str], runs: List[Run]) -> Table:
    best = best_per_step(runs)
    expected = list(range(len(ABLATION_LABELS)))
    order = expected + [k for k in best if k not in expected]  # off-list steps (or none) go last
    rows = []  # (label, run, the step's n/a reason, its fabric note)
    for k in order:
        run = best.get(k)
        label = ABLATION_LABELS[k] if k in expected else (run.label or f"step {k}")
        step = k if k in expected else (run.step if run else None)
        measured = run is not None and run.measured
        why = switches.inert(step, run.config, run.layout) if measured else None
        where = switches.fabric_note(step, run.fabric, run.layout) if measured and not why else None
        rows.append((label, run, why, where))
    markers, footnotes = switches.footnotes([f"n/a: {why}" if why else where for _, _, why, where in rows])
    cells, records, previous = [], [], None  # previous: (row index, label, MFU, window samples) of the last measured step
    for i, ((label, run, why, where), marker) in enumerate(zip(rows, markers)):
        row, rec = _ablation_row(label, run, why, previous, adjacent=previous is not None and previous[0] == i - 1)
        samples = rec.pop("_samples", None)
        row[0] += f" {marker}" if marker else ""
        cells.append(row)
        records.append({"study": "megascale_ablation", "scale": key[0], "fabric": key[1],
                        "step": order[i] if order[i] in expected else (run.step if run else None), "label": label,
                        **rec, "na_reason": why, "fabric_note": where})
        if rec["mfu"] is not None:
            previous = (i, label, rec["mfu"], samples)
    title = _title("Table 3 ablation (megascale_ablation)", key, [r["status"] for r in records])
    notes = [f"MFU: median over the steps after the first {intervals.WARMUP_STEPS}, ± its 95% interval from "
             f"{intervals.WINDOWS} windows of those steps. ΔMFU: MFU points against the previous step with a "
             f"measurement, ± the 95% interval of the difference (Welch); \"noise\" marks a change whose interval "
             f"holds zero. n/a: the step's switch has nothing to act on in this layout, so the row is not a "
             f"measurement of it. Exposed comm: median per step, n/a where the run did not log it."]
    if "pending" in [r["status"] for r in records]:
        notes.append("pending: the step's switch has not landed yet; the later steps ran without it (their rows say so).")
    notes += backends_note([(f"step {order[i]}", run) for i, (_, run, _, _) in enumerate(rows)])
    return Table(title, ["step", "MFU", "ΔMFU", "tokens/s", "step time", "exposed comm"], cells, records,
                 notes + footnotes)


def _ablation_row(label: str, run: Optional[Run], why: Optional[str], previous, adjacent: bool) -> Tuple[List[str], dict]:
    """One step's cells and CSV record. ΔMFU names the step it compares with when steps in between
    have no measurement (or nothing to act on), so a gap is never folded silently into one step's gain."""
    status = "n/a" if why and run is not None and run.measured else (run.status if run else "missing")
    rec = {"status": status, "mfu": None, "mfu_ci95": None, "delta_mfu": None, "delta_ci95": None,
           "within_noise": None, "delta_vs": None, "tokens_per_s": None, "step_time": None, "exposed_comm_s": None,
           "world_size": getattr(run, "world", None), "batch": getattr(run, "batch", None),
           "dir": getattr(run, "dir", None)}
    if run is None or not run.measured or why:
        return [_name(label, run), _empty(status), "", "", "", ""], rec
    f = run.final
    samples = intervals.window_samples([r["mfu"] for r in read_metrics(run.dir) if r.get("mfu") is not None])
    rec.update(mfu=f["mfu"], mfu_ci95=intervals.half_width(samples) if samples else None, _samples=samples,
               tokens_per_s=f["tokens_per_s"], step_time=f["step_time"], exposed_comm_s=f.get("exposed_comm_s"))
    shown = ""
    if previous is not None:
        delta = f["mfu"] - previous[2]
        half = intervals.difference_half_width(previous[3], samples) if samples and previous[3] else None
        rec.update(delta_mfu=delta, delta_vs=previous[1], delta_ci95=half,
                   within_noise=None if half is None else abs(delta) <= half)
        shown = pct(delta, True) + (f" ± {100 * half:.1f}" if half is not None else " ± ? (too few steps)")
        shown += " (noise)" if rec["within_noise"] else ""
        shown += "" if adjacent else f" (vs {previous[1].split(' (')[0]})"
    comm = f.get("exposed_comm_s")
    mfu = pct(f["mfu"]) + (f" ± {100 * rec['mfu_ci95']:.1f}" if rec["mfu_ci95"] is not None else "")
    return [_name(label, run), mfu, shown, f"{f['tokens_per_s']:,.0f}", seconds(f["step_time"]),
            "n/a" if comm is None else seconds(comm)], rec


def scaling(runs: Sequence[Run]) -> List[Table]:
    return [_scaling_group(key, group) for key, group in groups(runs, "strong_scaling").items()]


def _scaling_group(key: Tuple[str, str], runs: List[Run]) -> Table:
    runs = sorted(runs, key=lambda r: (r.batch or 0, r.world or 0))
    base: Dict[Optional[int], float] = {}  # batch -> tokens/s per device of its smallest measured run
    for r in runs:
        if r.measured and r.world:
            base.setdefault(r.batch, r.final["tokens_per_s"] / r.world)
    cells, records = [], []
    for r in runs:
        rec = {"study": "strong_scaling", "scale": key[0], "fabric": key[1], "label": r.label, "status": r.status,
               "gpus": r.world, "batch": r.batch, "step_time": None, "tokens_per_s": None, "mfu": None,
               "scaling_efficiency": None, "dir": r.dir}
        gpus, batch = "?" if r.world is None else str(r.world), "?" if r.batch is None else str(r.batch)
        if not (r.measured and r.world):
            cells.append([gpus, batch, _empty(r.status), "", "", ""])
        else:
            f = r.final
            eff = f["tokens_per_s"] / r.world / base[r.batch]
            rec.update(step_time=f["step_time"], tokens_per_s=f["tokens_per_s"], mfu=f["mfu"], scaling_efficiency=eff)
            cells.append([_name(gpus, r), batch, seconds(f["step_time"]), f"{f['tokens_per_s']:,.0f}",
                          pct(f["mfu"]), pct(eff)])
        records.append(rec)
    title = _title("Table 2 strong scaling (strong_scaling)", key, [r["status"] for r in records])
    notes = ["Scaling efficiency: (tokens/s / GPUs) / (tokens/s / GPUs of the fewest-GPU measured run "
             "at the same batch)."] + backends_note([(f"{r.world} GPUs, batch {r.batch}", r) for r in runs])
    return Table(title, ["GPUs", "batch", "step time", "tokens/s", "MFU", "scaling eff."], cells, records, notes)


def convergence(runs: Sequence[Run]) -> List[Table]:
    return [_convergence_group(key, group) for key, group in groups(runs, "convergence").items()]


def _convergence_group(key: Tuple[str, str], runs: List[Run]) -> Table:
    cells, records = [], []
    # A variant whose name promises a window (ptb_swa) with nothing for the window to act on says so.
    why = {r.dir: switches.window_inert(r.config) for r in runs if "swa" in (r.label or "") and r.config}
    markers, notes = switches.footnotes([f"n/a for SWA: {why[r.dir]}" if why.get(r.dir) else None for r in runs])
    for r, marker in zip(runs, markers):
        f, label = r.final, r.label or Path(r.dir).name
        val = f.get("val_loss")
        rec = {"study": "convergence", "scale": key[0], "fabric": key[1], "label": label, "status": r.status,
               "tokens": None, "loss": None, "val_loss": None, "swa_na_reason": why.get(r.dir), "dir": r.dir}
        shown = label + (f" {marker}" if marker else "")
        if not r.measured:
            cells.append([shown, _empty(r.status), "", ""])
        else:
            rec.update(tokens=r.tokens, loss=f["loss"], val_loss=val)
            cells.append([_name(shown, r), count(r.tokens), f"{f['loss']:.3f}",
                          "n/a" if val is None else f"{val:.3f}"])
        records.append(rec)
    title = _title("Convergence (convergence)", key, [r["status"] for r in records])
    notes = notes + backends_note([(r.label or Path(r.dir).name, r) for r in runs])
    return Table(title, ["variant", "tokens seen", "final loss", "val loss"], cells, records, notes)


BUILDERS = {"megascale_ablation": ablation, "strong_scaling": scaling, "convergence": convergence}


def build(runs: Sequence[Run]) -> Dict[str, List[Table]]:
    """{study: its tables}, for the studies that have runs."""
    return {study: tables for study, make in BUILDERS.items() if (tables := make(runs))}


def ablation_table(runs: Sequence[Run]) -> str:
    return "\n\n".join(t.markdown() for t in ablation(runs))


def scaling_table(runs: Sequence[Run]) -> str:
    return "\n\n".join(t.markdown() for t in scaling(runs))


def convergence_table(runs: Sequence[Run]) -> str:
    return "\n\n".join(t.markdown() for t in convergence(runs))


# --- Files ---

def refuse_existing(paths: Iterable[Path]) -> None:
    """Results are never silently replaced: refuse before writing anything."""
    for path in paths:
        if path.exists():
            raise SourceError(f"{path} exists; refusing to overwrite results. Fix: pass --out NEW_DIR, or move it away")


def to_csv(tables: List[Table]) -> str:
    records = [r for t in tables for r in t.records]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(records[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: "" if v is None else v for k, v in r.items()} for r in records)
    return buf.getvalue()


def write(built: Dict[str, List[Table]], out: Path) -> List[Path]:
    files = {out / f"{study}.{ext}": (to_csv(tables) if ext == "csv" else "\n\n".join(t.latex() for t in tables) + "\n")
             for study, tables in built.items() for ext in ("csv", "tex")}
    refuse_existing(files)
    out.mkdir(parents=True, exist_ok=True)
    for path, text in files.items():
        path.write_text(text)
    return list(files)


# --- Command line ---

def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Paper-style tables (Markdown, LaTeX, CSV) from multirun dirs.")
    p.add_argument("dirs", nargs="*", help="Hydra multirun dirs (or single run dirs)")
    p.add_argument("--wandb-group", help="also read this W&B group (online only)")
    p.add_argument("--wandb-project", default="megarepro", help="[entity/]project of the group")
    p.add_argument("--out", help="where the .tex and .csv go (default: the first dir)")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        if not args.dirs and not (args.wandb_group and args.out):
            raise SourceError("nothing to read. Fix: give multirun dirs, or --wandb-group G with --out DIR")
        runs = load_runs(args.dirs)
        if args.wandb_group:
            runs += load_wandb_group(args.wandb_group, args.wandb_project)
        built = build(runs)
        if not built:
            raise SourceError(f"none of {len(runs)} runs names a study ({', '.join(STUDIES)}) in run.json. "
                              f"Fix: run them with an experiment preset that sets study.name")
        paths = write(built, Path(args.out or args.dirs[0]))
    except SourceError as err:
        print(err, file=sys.stderr)
        return 2
    print("\n\n".join(t.markdown() for tables in built.values() for t in tables))
    unused = sum(r.study not in STUDIES for r in runs)
    print("\nwrote\n" + "\n".join(f"  {p}" for p in paths))
    if unused:  # plain runs (no experiment preset) in the same dir: say so rather than drop them silently
        print(f"left out (no study in run.json): {unused} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
