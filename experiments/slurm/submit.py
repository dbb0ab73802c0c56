"""sbatch with a precheck: rehearse rank 0 of the job's layout on this (login) node first, then
submit experiments/slurm/train.sbatch. A job that cannot be built, breaks NCCL's rules or does
not fit in the GPUs' memory fails here in a minute or so, not after the queue.

    python experiments/slurm/submit.py --nodes 32 --gpus-per-node 8 -- experiment=megascale_ablation scale=cluster ablation.step=3

Options before `--` go to sbatch (--nodes and --gpus-per-node also size the rehearsed world);
everything after it goes to train.py. The precheck follows rehearse.precheck (on at
scale=cluster); --no-precheck skips it.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def split(argv: list) -> tuple:
    if "--" not in argv:
        return argv, []
    k = argv.index("--")
    return argv[:k], argv[k + 1:]


def option(args: list, name: str, default: int) -> int:
    for k, a in enumerate(args):
        if a == name and k + 1 < len(args):
            return int(args[k + 1])
        if a.startswith(name + "="):
            return int(a.split("=", 1)[1])
    return default


def main(argv=None) -> int:
    import config
    from clustermodel import rehearsal
    sbatch_args, overrides = split(list(sys.argv[1:] if argv is None else argv))
    skip = "--no-precheck" in sbatch_args
    sbatch_args = [a for a in sbatch_args if a != "--no-precheck"]
    world = option(sbatch_args, "--nodes", 1) * option(sbatch_args, "--gpus-per-node", 8)  # train.sbatch's default
    jobs = config.preflight(overrides, remote_world=world)  # bad input: one line, exit 2
    if not skip and jobs and jobs[0][1].rehearse.precheck:
        print(f"precheck: rehearsing rank 0 of a {world}-rank job before submitting", flush=True)
        why = rehearsal.precheck([(overrides, jobs[0][1], world)], Path(tempfile.mkdtemp(prefix="megarepro-precheck-")))
        if why:
            print(f"precheck failed: {why}. Fix: change the layout, or --no-precheck to submit anyway", file=sys.stderr)
            return 2
    return subprocess.run(["sbatch", *sbatch_args, str(ROOT / "experiments" / "slurm" / "train.sbatch"), *overrides],
                          cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
