"""The paper's jobs, rehearsed (clustermodel/rehearsal.py): Table 3's 9 steps (175B on 256 GPUs, TP8 PP8 vpp6
DP4), Table 2's 8 rows (175B on 256-12,288 GPUs) and the 530B model on 2,240, 4,480 and 11,200
GPUs (MegaScale's settings, batch = GPUs, as `python -m clustermodel 530b`), Llama 3 70B on
256 GPUs (LLAMA_70B) and Llama 3 405B on 8,192 and 16,384 GPUs with fully sharded and hybrid-sharded
data parallelism (predict_llama3_405b.py's settings). Each job rehearses its first
and last rank (the first and last pipeline stage: the most in flight, and the logits), 2 steps,
NCCL's rules on; the table gives each job's peak memory per GPU, split, and its communication per
step, per mesh dimension, and is appended to experiments/results/rehearsal_paper.md.

    python experiments/rehearse_paper.py [--jobs table3,table2,530b,llama70b,llama405b] [--only "step 0,2240 GPUs"] [--out DIR]
    python experiments/rehearse_paper.py --render DIR/results.json ...   # the table of finished jobs
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import machine  # noqa: E402
import metrics  # noqa: E402

TABLE2 = [256, 512, 768, 1024, 3072, 6144, 8192, 12288]
GPUS_530B = [2240, 4480, 11200]
LABELS = ["baseline", "+PTB", "+SWA", "+TP overlap", "+PP overlap", "+DP overlap", "+efficient operators",
          "+misc (data pipeline)", "+LAMB (batch x3)"]

# Llama 3 70B on 256 H100s (Meta trained Llama 3 on H100 80 GB): Llama 3's 8,192-token sequences
# and its first batch of 4M tokens (512 sequences; Dubey et al. 2024, section 3.4.1, for 405B: the
# 70B's is not published), TP8 inside a host, and PP4 with 5 virtual stages of 4 layers: one of the
# layouts `python -m clustermodel plan` ranks within 0.2 points of its best at this batch, with
# fewer layers in flight on the first rank than PP2's. Its architecture as published (sequential
# block, full causal attention: no PTB or SWA), and the MegaScale switches that leave the maths
# alone: TP overlap in 4 pieces, PP and DP overlap on ZeRO-1, flash attention and the fused
# kernels, the two-level data pipeline; AdamW.
LLAMA_70B = ["scale=cluster", "model=llama3_70B", "hardware=h100_cluster", "train.seq_len=8192", "train.batch_size=512",
             "parallel.tp=8", "parallel.pp=4", "parallel.vpp=5", "parallel.dp=8", "parallel.microbatches=64",
             "parallel.zero_stage=1", "parallel.overlap.tp=chunked", "parallel.overlap.tp_chunks=4",
             "parallel.overlap.pp=true", "parallel.overlap.dp=true", "kernels.attention=auto", "kernels.fused=true",
             "data.pipeline=megascale", "optim.name=adamw", "train.recompute=none"]

def jobs(which: list) -> list:
    """(table, label, world, overrides) of every job, tables in the order asked."""
    out = []
    for table in which:
        if table == "table3":
            out += [("Table 3", f"step {k}: {LABELS[k]}", 256, ["experiment=megascale_ablation", "scale=cluster",
                                                               f"ablation.step={k}"]) for k in range(9)]
        elif table == "table2":
            out += [("Table 2", f"{g} GPUs", g, ["experiment=strong_scaling", "scale=cluster", f"scaling.row={row}"])
                    for row, g in enumerate(TABLE2)]
        elif table == "530b":  # clustermodel.cli.megascale_config("530B") at batch = GPUs, one sequence per microbatch
            for g in GPUS_530B:
                dp = g // (8 * 35)
                out.append(("530B", f"{g} GPUs", g, ["experiment=megascale_ablation", "scale=cluster", "ablation.step=7",
                                                      "model=530B", "parallel=megascale_530B", "parallel.dp=-1",
                                                      f"train.batch_size={g}", f"parallel.microbatches={g // dp}"]))
        elif table == "llama70b":
            out.append(("Llama 3 70B", "TP8 PP4 vpp5 DP8 seq 8192", 256, LLAMA_70B))
        elif table == "llama405b":
            # Llama 3 405B at Meta's layout, each way the code can shard it (predict_llama3_405b.py prices the same)
            from predict_llama3_405b import jobs as jobs_405b
            out += [("Llama 3 405B", f"{gpus} GPUs, {name}", gpus, ["scale=cluster", *overrides])
                    for gpus, name, overrides in jobs_405b()]
        else:
            raise SystemExit(f"--jobs: unknown table {table!r}. Fix: a comma list of table3, table2, 530b, llama70b, llama405b")
    return out


def run(table: str, label: str, world: int, overrides: list, out: Path) -> dict:
    folder = out / re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{table.replace(' ', '')}-{label.split(':')[0]}")  # Hydra's grammar
    cmd = [sys.executable, "train.py", *overrides, f"rehearse.ranks=[0,{world - 1}]", f"rehearse.world={world}",
           f"hydra.run.dir={folder}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    summary = json.loads((folder / "rehearsal.json").read_text()) if (folder / "rehearsal.json").exists() else {}
    return {"table": table, "label": label, "world": world, "exit": proc.returncode, "seconds": time.perf_counter() - t0,
            "command": "python train.py " + " ".join(overrides) + f" 'rehearse.ranks=[0,{world - 1}]' rehearse.world={world}",
            "rows": summary.get("table", []), "problems": summary.get("problems", [proc.stdout[-500:] + proc.stderr[-500:]])}


def render(results: list) -> str:
    lines = ["| job | GPUs | rank (dp,pp,tp) | peak GiB | weights | grads | optimizer | activations | fits (GiB tensors may use) | "
             "TP GiB/step | PP GiB/step | DP GiB/step (shard + replicate groups) | groups / p2p peers / checkpoint peers / resume fs calls | "
             "time per rank | NCCL rules |", "|" + "---|" * 15]
    for r in results:
        rule = "kept" if not r["problems"] else f"{len(r['problems'])} problems"
        for row in r["rows"]:
            comm = row["comm_gib"]
            lines.append(f"| {r['table']} {r['label']} | {r['world']:,} | {row['rank']} ({row['dp']},{row['pp']},{row['tp']}) | "
                         f"{row['peak_gib']:.1f} | {row['weights']:.1f} | {row['gradients']:.1f} | {row['optimizer']:.1f} | "
                         f"{row['activations']:.1f} | {'yes' if row['fits'] else 'NO: ' + row['dominant']} ({row.get('capacity_gib', 80):g}) | "
                         f"{comm.get('tp', 0):.1f} | {comm.get('pp', 0):.2f} | {dp_gib(comm)} | {costs(row)} | "
                         f"{row['seconds']:.0f} s | {rule} |")
        if not r["rows"]:
            lines.append(f"| {r['table']} {r['label']} | {r['world']:,} | failed (exit {r['exit']}) | | | | | | | | | | | | {rule} |")
    return "\n".join(lines)


def dp_gib(comm: dict) -> str:
    """DP's bytes a step, and under hybrid sharding its shard and replicate groups' apart."""
    split = [f"{comm[k]:.2f}" for k in ("dp_shard", "dp_replicate") if k in comm]
    return f"{comm.get('dp', 0):.2f}" + (f" ({' + '.join(split)})" if split else "")


def costs(row: dict) -> str:
    c = row.get("costs") or {}
    return " / ".join("-" if c.get(k) is None else str(c[k])
                      for k in ("groups", "p2p_pairs", "checkpoint_peers", "resume_check_fs_calls"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", default="table3,table2,530b")
    parser.add_argument("--only", default="", help="comma list: only the jobs whose '<table> <label>' holds one")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "rehearse_paper"))
    parser.add_argument("--render", nargs="+", metavar="RESULTS_JSON",
                        help="no rehearsal: append the table of these results.json (e.g. of a cut-off sweep)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.render:
        results = [r for path in args.render for r in json.loads(Path(path).read_text())]
        append(results, f"`python experiments/rehearse_paper.py --render {' '.join(args.render)}`")
        return 0
    results, only = [], [o for o in args.only.split(",") if o]
    for table, label, world, overrides in jobs(args.jobs.split(",")):
        if only and not any(o in f"{table} {label}" for o in only):
            continue
        results.append(run(table, label, world, overrides, out))
        r = results[-1]
        print(f"{table} {label}: exit {r['exit']}, {r['seconds']:.0f} s, problems {len(r['problems'])}", flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))  # so far: a cut-off sweep keeps its jobs
    append(results, f"`python experiments/rehearse_paper.py --jobs {args.jobs}{' --only ' + repr(args.only) if only else ''}`, git {metrics.git_commit()}, "
                    f"{machine.cpu_model()}, 2 ranks at a time")
    return 0 if all(r["exit"] == 0 for r in results) else 1


def append(results: list, heading: str) -> None:
    """The table, printed and appended to experiments/results/rehearsal_paper.md (never overwritten)."""
    text = render(results)
    print(text)
    results_dir = ROOT / "experiments" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    with open(results_dir / "rehearsal_paper.md", "a") as f:
        f.write(f"\n## {datetime.datetime.now():%Y-%m-%d %H:%M} ({heading})\n\n")
        f.write(text + "\n")
        for r in results:
            for p in r["problems"][:5]:
                f.write(f"- {r['table']} {r['label']}: {p}\n")


if __name__ == "__main__":
    sys.exit(main())
