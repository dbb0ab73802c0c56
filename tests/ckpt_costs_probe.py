"""What a rank's checkpointing costs in connections, store reads and file-system calls, counted on
real gloo ranks (tests/test_checkpoint.py): the checkpoint group's creation, one save and one
resume check."""
import builtins
import contextlib
import json
import os
import pathlib
from pathlib import Path

import torch
import torch.distributed as dist


class CountingStore(dist.Store):
    """A c10d store that counts its reads (gloo reads a peer's address from it per connection)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.reads = inner, 0

    def get(self, key):
        self.reads += 1
        return self.inner.get(key)

    def set(self, key, value):
        return self.inner.set(key, value)

    def add(self, key, n):
        return self.inner.add(key, n)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys, timeout=None):
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys):
        return self.inner.check(keys)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)


def sockets() -> int:
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sum(f.startswith("socket:") for f in fds)


@contextlib.contextmanager
def file_system_calls(counts: dict):
    """Counts stat calls (exists, is_file and stat itself), opened files and listed entries."""
    stat, iterdir, opener = pathlib.Path.stat, pathlib.Path.iterdir, builtins.open

    def counted_stat(self, *a, **k):
        counts["stat"] = counts.get("stat", 0) + 1
        return stat(self, *a, **k)

    def counted_iterdir(self):
        for entry in iterdir(self):
            counts["listed"] = counts.get("listed", 0) + 1
            yield entry

    def counted_open(*a, **k):
        counts["open"] = counts.get("open", 0) + 1
        return opener(*a, **k)

    pathlib.Path.stat, pathlib.Path.iterdir, builtins.open = counted_stat, counted_iterdir, counted_open
    try:
        yield counts
    finally:
        pathlib.Path.stat, pathlib.Path.iterdir, builtins.open = stat, iterdir, opener


def checkpoint_costs(rank, world, port, out):
    import checkpoint
    from parallelisms import placement
    store = CountingStore(dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    dist.barrier()
    found = {}
    sockets0, reads0 = sockets(), store.reads
    saver = checkpoint.Saver(Path(out) / "ckpt", keep=0)
    found["start"] = {"sockets": sockets() - sockets0, "store_reads": store.reads - reads0}
    # Every rank counts its start before any save begins: a peer's save connects to this rank
    # lazily, and a count taken after it would charge that to the checkpoint group's creation.
    dist.barrier()  # the world group's: its connections exist already
    state = {"model/w": placement.Chunks((world, 4), [((rank, 0), torch.full((1, 4), float(rank)))])}
    with file_system_calls({}) as calls:
        saver.save(1, state)
    found["save"] = {"sockets": sockets() - sockets0, "store_reads": store.reads - reads0, "fs": calls}
    dist.barrier()  # rank 0 has put the step in place
    with file_system_calls({}) as calls:
        why = checkpoint.problem(checkpoint.step_dir(saver.ckpt_dir, 1), group=saver.group)
    found["verify"] = {"sockets": sockets() - sockets0, "store_reads": store.reads - reads0, "fs": calls, "why": why}
    Path(out, f"costs{rank}.json").write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()
