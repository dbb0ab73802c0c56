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
    dp_shard: int = 0       # ZeRO's shard group: this many consecutive DP ranks (0: all of dp)
    reshard: bool = True    # ZeRO-3: gathered parameters freed after each module's forward
    chunks: Tuple[int, ...] = ()  # blocks of each model chunk in model order where uneven; (): n_layers/(pp*vpp) each
    reduce_each: bool = False  # ZeRO 2/3: each microbatch's gradients reduce-scattered (parallel.reduce_each_microbatch)

    @property
    def shard(self) -> int:
        """Ranks ZeRO shards over: parallel.dp_shard, or all of dp."""
        return self.dp_shard if 0 < self.dp_shard < self.dp else self.dp

    def group(self, dim: str) -> Tuple[int, int]:
        """(members, rank stride between consecutive members) of one `dim` group, ranks numbered by
        the mesh order. dp_shard: the DP ranks one ZeRO shard spans (consecutive DP ranks);
        dp_replicate: the ranks holding the same shard (one per shard group)."""
        sizes = {"tp": self.tp, "pp": self.pp, "dp": self.dp}
        if dim == "dp_shard":
            return self.shard, self.group("dp")[1]
        if dim == "dp_replicate":
            return self.dp // self.shard, self.group("dp")[1] * self.shard
        inner = self.order[self.order.index(dim) + 1:]
        return sizes[dim], math.prod(sizes[d] for d in inner)

    def members_per_host(self, dim: str, devices_per_host: int) -> int:
        """How many ranks of one `dim` group share a host (or, given a zone's ranks, a zone)."""
        n, stride = self.group(dim)
        return 1 if stride >= devices_per_host else min(n, max(1, devices_per_host // stride))

    def rank_chunks(self, rank: int, n_layers: int) -> list:
        """Blocks of each model chunk pipeline rank `rank` holds (virtual stage s on rank s % pp)."""
        chunks = self.chunks or (n_layers // (self.pp * self.vpp),) * (self.pp * self.vpp)
        return list(chunks[rank::self.pp])

    def rank_layers(self, rank: int, n_layers: int) -> int:
        """Blocks pipeline rank `rank` holds: n_layers/pp where chunks are even."""
        return sum(self.rank_chunks(rank, n_layers)) if self.chunks else n_layers // self.pp


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
    uneven = p.pp_first_chunk_layers != -1 or p.pp_last_chunk_layers != -1
    chunks = tuple(parallel.chunk_layers(cfg.model.n_layers, p)) if uneven else ()
    return JobLayout(gpus, p.tp, p.pp, p.vpp, dp, p.microbatches, t.batch_size // (dp * p.microbatches),
                     t.seq_len, p.zero_stage, tuple(p.order.split(",") if isinstance(p.order, str) else p.order),
                     p.dp_shard if p.dp_shard > 0 else dp, p.reshard_after_forward, chunks,
                     p.reduce_each_microbatch and p.zero_stage >= 2 and p.microbatches > 1)
