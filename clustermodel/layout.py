"""The whole job's layout as the cluster model prices it: the sizes of its mesh dimensions, its
microbatches, and which ranks of a group share a host (a rank's own place in it: parallel.Layout).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import config
import parallel
from errors import ConfigError


@dataclass
class JobLayout:
    """The whole job's layout as the model prices it (a rank's own place in it: parallel.Layout)."""
    gpus: int
    tp: int
    pp: int
    vpp: int
    dp: int
    microbatches: int       # per step and DP rank
    micro_batch: int        # sequences per microbatch
    seq: int
    zero: int
    order: Tuple[str, ...] = ("dp", "pp", "tp")   # mesh dims, outermost first (parallel.order)

    def members_per_host(self, dim: str, devices_per_host: int) -> int:
        """How many ranks of one `dim` group share a host, ranks numbered by the mesh order."""
        sizes = {"tp": self.tp, "pp": self.pp, "dp": self.dp}
        inner = self.order[self.order.index(dim) + 1:]
        stride = math.prod(sizes[d] for d in inner)
        return 1 if stride >= devices_per_host else min(sizes[dim], max(1, devices_per_host // stride))


def layout_of(cfg: config.Config, gpus: Optional[int] = None) -> JobLayout:
    """The job's layout on `gpus` GPUs (default tp*pp*dp), checked as a run checks it (parallel.validate;
    the overlap switches' chunk counts aside: the model prices any)."""
    p, t = cfg.parallel, cfg.train
    gpus = gpus or p.tp * p.pp * max(p.dp, 1)
    if gpus % (p.tp * p.pp):
        raise ConfigError("parallel", f"tp*pp = {p.tp * p.pp} does not divide {gpus} GPUs", "choose tp and pp that divide the GPU count")
    if p.vpp > 1 and p.pp == 1:
        raise ConfigError("parallel.vpp", f"vpp={p.vpp} interleaves pipeline stages, and pp=1", "set parallel.vpp=1 or pp>1")
    parallel.validate(cfg, gpus, run=False)
    dp = gpus // (p.tp * p.pp)
    return JobLayout(gpus, p.tp, p.pp, p.vpp, dp, p.microbatches, t.batch_size // (dp * p.microbatches),
                  t.seq_len, p.zero_stage, tuple(p.order.split(",") if isinstance(p.order, str) else p.order))
