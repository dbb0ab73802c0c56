"""Fit the shape term of clustermodel/rates.gemm_time to published GEMM measurements.

gemm_time prices a GEMM [M,K] @ [K,N] as 2MNK / (peak x efficiency x shape), shape = M/(M+h) x
N/(N+h) x K/(K+h) (tile and wave quantization; h is hardware.perfmodel.gemm_half_dim), under a
memory roofline and the launch. The measurements (experiments/data/gemm_shapes_published.csv:
OpenXLA's measured H100 table, NVIDIA's published A100 cuBLAS sweep, the best shapes of
ml-engineering's MAMF search) time one kernel at a time, so here the launch adds to the work
(rates' `additive`), where in a training step's stream of kernels it overlaps it. For each GPU the
grid search finds the (efficiency, h) of least RMS of log(predicted / measured time), over all its
rows and over the rows whose dims are all at least MIN_DIM (the GEMMs of the runs the model is
validated on), and prints the error of the h each conf/hardware entry holds. The efficiency fitted
here is an isolated GEMM's ceiling at boost clocks; the one a training step reaches is fitted on
runs (experiments/fit_perfmodel.py) or a measured layer (conf/hardware/h100_cluster.yaml).

    python experiments/fit_gemm_shapes.py            # the fits (~10 s)
    python experiments/fit_gemm_shapes.py --append   # and append them to experiments/results/gemm_shapes.md
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from clustermodel import perfmodel as pm  # noqa: E402
from clustermodel import cli  # noqa: E402
from metrics import markdown_table  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "gemm_shapes_published.csv"
RESULTS = Path(__file__).resolve().parent / "results" / "gemm_shapes.md"
HARDWARE = {"H100": "h100_cluster", "A100": "a100_cluster"}  # whose peak, memory and launch price the rows
MIN_DIM = 1024
EFFICIENCIES = [e / 100 for e in range(60, 101)]  # at most the peak
HALF_DIMS = [0, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512]


def rows_of(gpu: str, min_dim: int = 0) -> list:
    """[(m, n, k, TFLOP/s)] of the GPU's measurements whose dims are all at least min_dim."""
    with DATA.open() as f:
        lines = [line for line in f if not line.startswith("#")]
    return [(int(r["m"]), int(r["n"]), int(r["k"]), float(r["tflops"])) for r in csv.DictReader(lines)
            if r["gpu"] == gpu and min(int(r["m"]), int(r["n"]), int(r["k"])) >= min_dim]


def isolated_rates(gpu: str) -> pm.Rates:
    """The GPU's rates as conf/hardware has them, with the launch added to each kernel's work."""
    hw = pm.resolve_hardware(cli.compose([f"hardware={HARDWARE[gpu]}"]).hardware)
    return dataclasses.replace(pm.Rates.of(hw, "bf16", 1), additive=True, gemm_shapes={})


def log_errors(rates: pm.Rates, rows, efficiency: float, half_dim: float) -> list:
    r = dataclasses.replace(rates, gemm_eff=efficiency, half_dim=half_dim)
    return [math.log(pm.gemm_time(r, m, n, k) / (2 * m * n * k / (tflops * 1e12))) for m, n, k, tflops in rows]


def rms(errs) -> float:
    return math.sqrt(sum(e * e for e in errs) / len(errs))


def fit(gpu: str, min_dim: int = 0, half_dims=HALF_DIMS) -> dict:
    """The (efficiency, half_dim) of least RMS log-time error over the GPU's rows, and that error."""
    rates, rows = isolated_rates(gpu), rows_of(gpu, min_dim)
    error, efficiency, half_dim = min((rms(log_errors(rates, rows, e, h)), e, h)
                                      for e in EFFICIENCIES for h in half_dims)
    worst = max(log_errors(rates, rows, efficiency, half_dim), key=abs)
    return {"rows": len(rows), "efficiency": efficiency, "half_dim": half_dim, "rms": error, "worst": worst}


def report() -> str:
    rows = []
    for gpu, name in HARDWARE.items():
        held = isolated_rates(gpu).half_dim
        for min_dim, label in ((0, "all"), (MIN_DIM, f"dims >= {MIN_DIM}")):
            best, conf = fit(gpu, min_dim), fit(gpu, min_dim, [held])
            rows.append([gpu, f"{label}: {best['rows']}", f"{best['efficiency']:.2f}, {best['half_dim']:g}",
                         f"{best['rms']:.3f}", f"{best['worst']:+.3f}",
                         f"{name} h={held:g}: {conf['efficiency']:.2f}, {conf['rms']:.3f}"])
    return markdown_table(["GPU", "rows", "best: efficiency, half_dim", "RMS log-time error", "worst",
                           "the conf's half_dim: efficiency, RMS"], rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--append", action="store_true", help=f"append the table to {RESULTS.name}")
    args = p.parse_args(argv)
    table = report()
    print(table)
    if args.append:
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        with RESULTS.open("a") as f:
            f.write(f"\n## {stamp} · `python experiments/fit_gemm_shapes.py`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
