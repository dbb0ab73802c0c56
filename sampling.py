"""Which sequences each rank reads at each step, and the loaders that hand them to the training loop.

Sampler reads each step's sequences from the training stream's index (corpus/blend.py: each
source's epochs shuffled, seeded, and the sources of a blend drawn at their weights), which rank 0
builds once in the data cache and every rank memory-maps; a DP rank takes a contiguous slice of
each global batch, so dp ranks together read exactly what one process reads on the same global
batch. Its position is counted in sequences, so a resume may change the batch or the DP
degree. Loader prefetches in a thread but reports the position the training loop consumed, so
resuming from a checkpoint is bit-identical. A batch is one token stream [local_batch, seq_len + 1]
in the narrowest integer dtype that holds the vocabulary; to_device turns it into int64 inputs and
targets on the device, views of one tensor shifted by a token. train_loader builds what data.pipeline
asks for (MegaScale's: one reader per TP group, prefetching); middle pipeline stages never read. The
corpus itself is data.py's.
"""
from __future__ import annotations

import queue
import threading
from typing import Optional

import numpy as np
import torch

import data
from corpus import blend, build
from corpus.blend import SampleIndex, held_out_rows, shares
from data import Corpus, DataConfig, data_parts
from errors import ConfigError, fail


class Sampler:
    """The global batch of step s is the next B positions of the training stream (a
    corpus.blend.SampleIndex: each source's epochs shuffled, the sources blended by weight); DP rank
    r takes its contiguous B/dp slice. The stream is an index the ranks share, memory-mapped from
    the data cache: a rank reads its slice each step and holds nothing the size of the corpus.
    An int for `index` is a single source of that many sequences with its stream built in this
    process (tests, small tools); `seed` is for that case, a SampleIndex carries its own."""

    def __init__(self, index, global_batch: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0):
        if global_batch < 1 or global_batch % dp_size:
            raise ValueError(f"global_batch={global_batch} must be positive and divisible by dp_size={dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, {dp_size})")
        if isinstance(index, (int, np.integer)):
            if index < 1:
                raise ValueError(f"num_sequences={index}: there is nothing to sample")
            index = SampleIndex([int(index)], [1.0], seed, samples=2 * max(int(index), global_batch))
        self.index, self.global_batch, self.dp_rank, self.dp_size = index, global_batch, dp_rank, dp_size
        self.num_sequences, self.seed = index.num_sequences, index.seed
        self.consumed = 0  # sequences of the global stream consumed by all ranks together

    def next_indices(self) -> np.ndarray:
        local = self.global_batch // self.dp_size
        indices = self.index.rows(self.consumed + self.dp_rank * local, local)
        self.consumed += self.global_batch
        return indices

    def state_dict(self) -> dict:
        state = {"consumed": self.consumed, "seed": self.seed, "num_sequences": self.num_sequences}
        if self.index.stream is not None:  # a blend: its sources, weights and sizes
            state["blend"] = self.index.stream
        return state

    def load_state_dict(self, state: dict) -> None:
        # The position is counted in sequences, not steps, so a resume may change the global batch
        # or the DP degree and still continue the same stream.
        saved = (state["seed"], state["num_sequences"], state.get("blend"))
        if saved != (self.seed, self.num_sequences, self.index.stream):
            blended = lambda stream: f" blended as {stream}" if stream else ""
            raise ConfigError("resume", f"the checkpoint's data position is for seed={state['seed']} over "
                              f"{state['num_sequences']} sequences{blended(state.get('blend'))}, this run's for "
                              f"seed={self.seed} over {self.num_sequences}{blended(self.index.stream)}: the data or "
                              "seed changed (the corpus, data.sources, train.seq_len or train.seed)",
                              "resume with the corpus, train.seq_len and train.seed it was saved with, or resume=none")
        self.consumed = int(state["consumed"])


def token_dtype(vocab_size: int) -> torch.dtype:
    """The narrowest dtype a batch's token ids travel in: uint16 below 2**16 ids, else int32. A
    broadcast of it moves 4x (resp. 2x) fewer bytes than int64; a collective ships it as bytes
    (wire_view), since NCCL has no 16-bit integer type."""
    return torch.uint16 if vocab_size <= 2**16 else torch.int32


_NUMPY = {torch.uint16: np.uint16, torch.int32: np.int32}


def _rows_to_stream(rows: np.ndarray, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
    """[n, seq_len + 1] token ids (a row's inputs are its first seq_len, its targets its last)."""
    stream = torch.from_numpy(np.ascontiguousarray(rows, dtype=_NUMPY[dtype]))
    return stream.pin_memory() if pin_memory else stream


def to_device(stream: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), int64 on the device: the narrow stream is copied (asynchronously when
    pinned), widened there, and both are views of it, one token apart."""
    tokens = stream.to(device, non_blocking=True).long()
    return tokens[:, :-1], tokens[:, 1:]


def wire_view(stream: torch.Tensor) -> torch.Tensor:
    """The stream as a broadcast sends it: uint16 as its bytes (uint8: NCCL and gloo have no 16-bit
    integer type, and a broadcast does no arithmetic), int32 as it is."""
    return stream.view(torch.uint8) if stream.dtype == torch.uint16 else stream


class Loader:
    """Batches (token streams [local_batch, seq_len + 1], token_dtype), forever. A background thread
    keeps up to `prefetch` batches ready; state_dict() is the position after the batches handed out.
    `reads` counts the batches read from the corpus."""

    def __init__(self, corpus: Corpus, split: str, seq_len: int, sampler: Sampler, prefetch: int = 2,
                 pin_memory: bool = False):
        self.rows = corpus.sequences(split, seq_len)
        if sampler.num_sequences != len(self.rows):
            raise ValueError(f"the sampler covers {sampler.num_sequences} sequences, the {split} split has {len(self.rows)}")
        self.sampler, self.prefetch, self.pin_memory = sampler, prefetch, pin_memory
        self.dtype, self.reads = token_dtype(corpus.vocab_size), 0
        self._consumed = sampler.state_dict()
        self._queue: Optional[queue.Queue] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    def _make(self):
        self.reads += 1
        batch = _rows_to_stream(self.rows[self.sampler.next_indices()], self.dtype, self.pin_memory)
        return batch, self.sampler.state_dict()

    def _produce(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._make()
            except BaseException as err:  # handed to the consumer, which raises it in the training loop
                item = err
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def __iter__(self) -> "Loader":
        return self

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __next__(self) -> torch.Tensor:
        if self.prefetch == 0:
            batch, self._consumed = self._make()
            return batch
        if self._thread is None:
            self._stop.clear()
            self._queue = queue.Queue(maxsize=self.prefetch)
            self._thread = threading.Thread(target=self._produce, name="data-prefetch", daemon=True)
            self._thread.start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        batch, self._consumed = item
        return batch

    def skip(self) -> None:
        """Advance one batch without reading it: for a rank that receives its batch from another."""
        assert self.prefetch == 0, "skip() is for a loader that does not prefetch"
        self.sampler.next_indices()
        self._consumed = self.sampler.state_dict()

    def state_dict(self) -> dict:
        return {"sampler": dict(self._consumed)}

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self.sampler.load_state_dict(state["sampler"])
        self._consumed = self.sampler.state_dict()

    def close(self) -> None:
        """Stop the prefetch thread and rewind the sampler to what was consumed (prefetched batches
        are dropped); iterating again restarts from there."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread, self._queue = None, None
        self.sampler.load_state_dict(self._consumed)


class _OverLoader:
    """What TPSharedLoader and NoTokens share: a Loader underneath whose sampler keeps the
    checkpointed data position, whatever this rank reads."""
    loader: "Loader"

    def __iter__(self):
        return self

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

    def close(self) -> None:
        self.loader.close()


class TPSharedLoader(_OverLoader):
    """Redundant-loader elimination (data.tp_shared). The TP ranks of a DP slice need identical
    batches, and reading them once per rank repeats the work tp times. MegaScale has one reader per
    host that writes into shared memory; here TP rank 0 reads and broadcasts the narrow token stream
    (as bytes: wire_view) to its TP group. The other ranks advance their own sampler without
    reading, so every rank's checkpointed data position stays the same."""

    def __init__(self, loader: Loader, group, is_reader: bool, shape: tuple, device: torch.device):
        import torch.distributed as dist
        self.loader, self.group, self.is_reader, self.shape, self.device = loader, group, is_reader, shape, device
        self.src = dist.get_global_rank(group, 0)

    def __next__(self) -> torch.Tensor:
        import torch.distributed as dist
        stream = torch.empty(self.shape, dtype=self.loader.dtype, device=self.device)
        if self.is_reader:  # straight from the loader's (pinned, on CUDA) batch: no pageable copy between
            stream.copy_(next(self.loader), non_blocking=True)
        else:
            self.loader.skip()
        dist.broadcast(wire_view(stream), src=self.src, group=self.group)
        return stream


class NoTokens(_OverLoader):
    """A middle pipeline stage's batches: its layers take the previous stage's activations, never
    tokens (only the first stage needs inputs and the last targets, as in Megatron-LM), so it
    neither reads nor receives a batch. It still advances its sampler, so that its checkpointed
    data position is every other rank's. What it hands out has the batch's shape and nothing else
    (one int64 zero, expanded: no memory, no copy, and to_device leaves it where it is)."""

    def __init__(self, loader: Loader, shape: tuple, device: torch.device):
        self.loader = loader
        self.placeholder = torch.zeros((), dtype=torch.int64, device=device).expand(shape)

    def __next__(self) -> torch.Tensor:
        self.loader.skip()
        return self.placeholder


def train_loader(corpus: Corpus, cfg: DataConfig, seq_len: int, sampler: Sampler, tp_group=None,
                 tp_rank: int = 0, device: torch.device = torch.device("cpu"), pp_rank: int = 0, pp: int = 1):
    """The training batches as data.pipeline asks (ablation step 7, "misc"):
    naive:     every rank reads and prepares its own batch, in the training loop, when it needs it.
    megascale: the next batches are prepared in the background (data.prefetch deep) while the
               current step computes and synchronises gradients (data.prefetch_async), and under
               TP one rank per TP group reads them for the whole group (data.tp_shared).
    Either way a middle pipeline stage reads nothing (NoTokens)."""
    pin = device.type == "cuda"  # a pinned batch is copied to the GPU asynchronously, a pageable one with a host sync
    prefetch_async, tp_shared = data_parts(cfg)
    shape = (sampler.global_batch // sampler.dp_size, seq_len + 1)
    if 0 < pp_rank < pp - 1:
        return NoTokens(Loader(corpus, "train", seq_len, sampler, prefetch=0), shape, device)
    shared = tp_shared and tp_group is not None
    reader = not shared or tp_rank == 0
    loader = Loader(corpus, "train", seq_len, sampler, prefetch=cfg.prefetch if prefetch_async and reader else 0,
                    pin_memory=pin)
    return TPSharedLoader(loader, tp_group, reader, shape, device) if shared else loader


def eval_batches(corpus: Corpus, seq_len: int, n_batches: int, global_batch: int,
                 dp_rank: int = 0, dp_size: int = 1, pin_memory: bool = False) -> list[torch.Tensor]:
    """The same held-out batches (token streams, as Loader's) on every call: n_batches * global_batch
    sequences spread evenly over the val split (repeating only if it is smaller), each global batch
    sliced per DP rank (pinned with pin_memory, for asynchronous copies to a GPU). A blend draws them
    from every source's own val split, each at its weight."""
    sizes, units, _ = shares(corpus, "val", seq_len)
    if min(sizes) < 1:
        raise ValueError(f"the val split has no sequence of length {seq_len}: raise data.val_fraction or disable eval")
    if global_batch % dp_size:
        raise ValueError(f"global_batch={global_batch} must be divisible by dp_size={dp_size}")
    total = n_batches * global_batch
    picks = held_out_rows(sizes, units, total)  # each source's share of every batch, by its weight
    rows, local, dtype = corpus.sequences("val", seq_len), global_batch // dp_size, token_dtype(corpus.vocab_size)
    return [_rows_to_stream(rows[picks[b * global_batch + dp_rank * local: b * global_batch + (dp_rank + 1) * local]],
                            dtype, pin_memory) for b in range(n_batches)]


# --- A run's corpus and stream index, on every rank ---

def open_corpus(cfg: DataConfig, seq_len: int, rank: int, world: int):
    """The corpus (data.sources' blend, or data.source): built on first use by one process; opened
    by every rank of a larger job (its manifest and a memory map per shard), which never builds.
    Each rank checks its share of the shards' checksums, once (data.Corpus.verify); a data
    problem stops the job with one line."""
    try:
        corpora = [data.prepare(source, seq_len, world) for source in blend.source_configs(cfg)]
        for corpus in corpora:
            corpus.verify(rank, world)
        return blend.combine(corpora, cfg)
    except ConfigError as err:
        fail(str(err))


def shared_index(corpus, cfg: DataConfig, seq_len: int, seed: int, samples: int, rank: int, world: int) -> SampleIndex:
    """The training stream's index (corpus/blend.py) for the samples the run needs (max_steps x
    global batch), built once by rank 0 into the data cache and memory-mapped by every rank; a rank
    whose cache lacks the file (a node-local cache) builds it there under the file lock."""
    import torch.distributed as dist

    def shared():
        return blend.sample_index(corpus, seq_len, seed, samples, build.cache_root(cfg) / "index")
    index = shared() if rank == 0 else None
    if world > 1:
        dist.broadcast_object_list([None], src=0)  # the others map it once rank 0 has written it
    return index if rank == 0 else shared()
