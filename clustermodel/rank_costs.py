"""What one rank of a W-rank job costs beyond its tensors: communicators, connections, store reads
and file-system calls. rehearsal.py records them for each rehearsed rank (rehearsal.json), so that
nothing per rank grows with the world unseen.

- Communicators are counted: every process group the rank is a member of after the layout and
  the model are built (c10d's own table), and the point-to-point pairs its pipeline posts.
  Without a device bound at init, NCCL makes one more 2-rank communicator per (group, peer) of
  each unbatched send/recv at its first message; with one bound (launch.init_distributed on
  CUDA), sends and receives use their group's communicator (pytorch#129140, #132900).
- The checkpoint's connections, store reads and file-system calls follow the pattern counted on
  real gloo ranks (tests/test_checkpoint.py, tests/ckpt_costs_probe.py, 4 to 16 ranks): a lazily
  connected gloo group costs nothing to make; a save connects DCP's coordinator (rank 0) to every
  rank it gathers plans from and every other rank to at most log2(W) + 2 peers (gloo's broadcast
  and all-reduce trees); a resume check costs a rank a stat and an open per file it checks (one
  file in W) plus the manifest's. `before` is the code that made a full gloo mesh at start and
  had every rank stat every file of the manifest and list the step folder at every save.
"""
from __future__ import annotations

import math

import torch.distributed as dist


def communicators(events: list) -> dict:
    """This rank's process groups (their sizes) and the communicators NCCL would hold for them,
    with a device bound at init (`bound`) and without (`lazy`: plus a 2-rank one per peer of
    each group's unbatched sends and receives)."""
    from torch.distributed import distributed_c10d as c10d
    sizes = sorted((pg.size() for pg in c10d._world.pg_map), reverse=True)
    pairs = {(ev["comm"], ev["peer"]) for ev in events if ev.get("op") in ("send", "recv") and "peer" in ev}
    return {"groups": len(sizes), "group_sizes": sizes, "p2p_pairs": len(pairs), "bound": len(sizes),
            "lazy": len(sizes) + len(pairs)}


def checkpoint_costs(rank: int, world: int) -> dict:
    """Sockets and store reads of the checkpoint group, and file-system calls of a save and a
    resume check, for rank `rank` of `world`, before and after (see the module's docstring)."""
    files = world + 1  # a .distcp per rank and DCP's .metadata
    mine = len(range(rank, files, world))  # the files a resume check reads
    written = 1 + (rank == 0)               # the files a save writes and hashes
    peers = world - 1 if rank == 0 else min(world - 1, math.ceil(math.log2(max(world, 2))) + 2)
    # File-system calls of this code's own (DCP's writes aside): a stat per file listed or checked,
    # an open per file read; rank 0's manifest and rename come on top, once per save.
    return {
        "before": {"sockets": world - 1, "store_reads": world - 1, "resume_check_fs_calls": 2 + 2 * files + mine,
                   "save_fs_calls": 2 * files + 2 * written},
        "after": {"sockets": peers, "store_reads": peers, "sockets_at_start": 0, "store_reads_at_start": 0,
                  "resume_check_fs_calls": 2 + 2 * mine, "save_fs_calls": 2 * written},
    }


def heartbeat_fs_calls_per_second(world: int, heartbeat_interval: float, hang_timeout: float) -> dict:
    """File-system metadata calls a second, the whole job together, of the heartbeat files (an
    open with create, a close and a rename per write), before (every heartbeat_interval) and after
    (at most every hang_timeout / 10)."""
    return {"before": 3 * world / heartbeat_interval, "after": 3 * world / max(heartbeat_interval, hang_timeout / 10)}


def straggler_bytes(world: int, dp: int, pp: int) -> dict:
    """Bytes a rank receives per straggler window: before, an all-gather of one pickled (rank, host,
    seconds) over the world (and its size, 8 bytes, first); after (observe/stragglers.py), an all-gather of
    its 4 float64 over its dp group and a ring all-reduce of 2 + 2 pp int64 over the world, and
    where its dp group is one rank, a ring all-reduce of the world histogram (2 x BINS int32)."""
    import pickle
    from observe import stragglers
    mine = len(pickle.dumps((world - 1, "host-00000", 0.0)))
    reduced = 8 * (2 + 2 * pp) + (4 * 2 * stragglers.BINS if dp == 1 else 0)
    return {"before": (world - 1) * (mine + 8),
            "after": (dp - 1) * 8 * stragglers.FIGURES + 2 * (world - 1) * reduced // world}


def costs(rank: int, world: int, events: list, ft_cfg, layout=None) -> dict:
    """What rehearsal.py records for a rehearsed rank."""
    return {"communicators": communicators(events) if dist.is_initialized() else None,
            "stragglers_bytes_per_window": straggler_bytes(world, layout.dp, layout.pp) if layout else None,
            "checkpoint": checkpoint_costs(rank, world),
            "heartbeat_fs_calls_per_s_job": heartbeat_fs_calls_per_second(world, ft_cfg.heartbeat_interval,
                                                                          ft_cfg.hang_timeout)}


def corpus_start_fs_calls(shards: int, rank: int, world: int) -> int:
    """File-system calls (opens and stats) of one rank's corpus at start-up in a job of `world`
    ranks (tests/test_data.py counts them): the build check and the config's data check (a stat
    of the source's name each, the manifest's open), opening the corpus (a stat of the source's
    name and of its folder, the manifest again, an open and an fstat per shard, which it maps), and
    its share of the checksums (every world-th shard: a stat of the shard, its marker's open).
    Nothing lists or stats the source's files, and nothing grows with the world. The sample index
    (corpus/blend.py) adds a stat, an open and a map per rank, and a blend of k sources k corpora."""
    mine = len(range(rank, shards, world))
    return 6 + 2 * shards + 2 * mine
