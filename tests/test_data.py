"""data.py: packing, caching, sources, tokenizers, and the deterministic sampler/loader.

Every corpus here is a few KB written to tmp_path; nothing is downloaded."""
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before datasets is imported anywhere
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hashlib
import json
import multiprocessing
import platform
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402
import sampling  # noqa: E402
from config import ConfigError  # noqa: E402

DOCS = [
    "def add(a, b):\n    return a + b\n",
    "Ünïcödé text: 日本語 and emoji 🙂, spanning multi-byte characters.\n" * 3,
    "A document that mentions <|endoftext|> literally, which must stay text.\n",
    "\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(40)),
] * 3
STREAM = "".join(d + data.EOT for d in DOCS)


def write_jsonl(path: Path, docs=DOCS, field="text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def config(tmp_path: Path, source, **overrides) -> data.DataConfig:
    base = dict(source=str(source), tokenizer="bytes", val_fraction=0.0, cache_dir=str(tmp_path / "cache"))
    return data.DataConfig(**{**base, **overrides})


def all_tokens(corpus: data.Corpus) -> np.ndarray:
    return np.concatenate([corpus.train, corpus.val])


@pytest.fixture(scope="module")
def jsonl_corpus(tmp_path_factory):
    """One small bytes-tokenized corpus shared by the sampler and loader tests."""
    tmp = tmp_path_factory.mktemp("shared")
    return data.prepare(config(tmp, write_jsonl(tmp / "docs.jsonl"), val_fraction=0.2), seq_len=16)


# --- Packing ---

@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_packing_round_trip(tmp_path, tokenizer):
    corpus = data.prepare(config(tmp_path, write_jsonl(tmp_path / "d.jsonl"), tokenizer=tokenizer,
                                 bpe_vocab_size=300, val_fraction=0.1), seq_len=8)
    tokens = all_tokens(corpus)
    assert corpus.decode(tokens) == STREAM
    # One end-of-text per document: the literal "<|endoftext|>" inside a document stays text.
    assert (tokens == corpus.eot_id).sum() == len(DOCS)
    assert tokens.max() < corpus.vocab_size and tokens.dtype == np.uint16
    assert corpus.meta["documents"] == len(DOCS) and corpus.meta["tokens"] == len(tokens)
    if tokenizer == "bytes":
        assert corpus.vocab_size == 257 and len(tokens) == len(STREAM.encode()) - len(DOCS) * (len(data.EOT) - 1)
    else:
        assert 257 < corpus.vocab_size <= 300 and len(tokens) < len(STREAM.encode()) / 1.5  # merges compress


def test_sequences_and_targets_are_shifted_windows(jsonl_corpus):
    T = 16
    rows = jsonl_corpus.sequences("train", T)
    assert len(rows) == jsonl_corpus.num_sequences("train", T) == (len(jsonl_corpus.train) - 1) // T
    for i in (0, 1, len(rows) - 1):
        np.testing.assert_array_equal(rows[i], jsonl_corpus.train[i * T: i * T + T + 1])
    sampler = sampling.Sampler(len(rows), global_batch=4, seed=3)
    stream = next(sampling.Loader(jsonl_corpus, "train", T, sampler, prefetch=0))
    assert stream.dtype == torch.uint16 and stream.shape == (4, T + 1)  # one narrow stream, not int64 pairs
    inputs, targets = sampling.to_device(stream, torch.device("cpu"))
    idx = sampling.Sampler(len(rows), global_batch=4, seed=3).next_indices()
    assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == targets.shape == (4, T)
    train = torch.from_numpy(jsonl_corpus.train.astype(np.int64))
    for row, i in enumerate(idx):
        assert torch.equal(inputs[row], train[i * T: i * T + T])
        assert torch.equal(targets[row], train[i * T + 1: i * T + T + 1])


def test_val_is_the_tail_and_val_fraction_reslices_without_rebuilding(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl")
    whole = data.prepare(config(tmp_path, source), seq_len=8)
    split = data.prepare(config(tmp_path, source, val_fraction=0.25), seq_len=8)
    assert split.meta["reused"] and split.path == whole.path
    n_val = int(len(whole.train) * 0.25)
    np.testing.assert_array_equal(split.val, whole.train[-n_val:])
    np.testing.assert_array_equal(split.train, whole.train[:-n_val])


def test_a_val_split_too_small_for_one_sequence_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as err:
        data.prepare(config(tmp_path, write_jsonl(tmp_path / "d.jsonl"), val_fraction=0.001), seq_len=64)
    assert err.value.key == "data.val_fraction"


# --- Cache ---

def test_second_prepare_reuses_the_cache(tmp_path):
    cfg = config(tmp_path, write_jsonl(tmp_path / "d.jsonl"), tokenizer="bpe", bpe_vocab_size=300)
    first = data.prepare(cfg, seq_len=8)
    stats = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in first.path.iterdir()}
    second = data.prepare(cfg, seq_len=32)  # another seq_len reads the same token file
    assert not first.meta["reused"] and second.meta["reused"]
    assert second.path == first.path
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in second.path.iterdir()} == stats
    np.testing.assert_array_equal(second.train, first.train)


def test_other_ranks_open_the_readers_entry_without_reading_the_source(tmp_path, monkeypatch):
    """train.prepare_data: rank 0 hashes the corpus; the others get its cache entry's name and,
    where their cache holds it, never read the source (256 reads of shared storage at 256 ranks)."""
    cfg = config(tmp_path, write_jsonl(tmp_path / "d.jsonl"))
    reader = data.prepare(cfg, seq_len=8)
    monkeypatch.setattr(data, "open_source", lambda *a: pytest.fail("a non-reader read the source"))
    other = data.prepare(cfg, seq_len=8, known=reader.path.name)
    assert other.path == reader.path and other.meta["reused"]
    np.testing.assert_array_equal(other.train, reader.train)
    # A machine whose cache lacks the entry (a node-local cache) builds it itself.
    monkeypatch.undo()
    elsewhere = config(tmp_path, write_jsonl(tmp_path / "d.jsonl"), cache_dir=str(tmp_path / "node2"))
    built = data.prepare(elsewhere, seq_len=8, known=reader.path.name)
    assert built.path.name == reader.path.name and not built.meta["reused"]


def test_changed_input_invalidates_the_cache(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl")
    base = data.prepare(config(tmp_path, source), seq_len=8)
    write_jsonl(source, DOCS[:-1] + ["a different last document\n"])
    edited = data.prepare(config(tmp_path, source), seq_len=8)
    capped = data.prepare(config(tmp_path, source, max_bytes=500), seq_len=8)
    bpe = data.prepare(config(tmp_path, source, tokenizer="bpe", bpe_vocab_size=300), seq_len=8)
    paths = {base.path, edited.path, capped.path, bpe.path}
    assert len(paths) == 4 and not any(c.meta["reused"] for c in (edited, capped, bpe))
    assert edited.decode(edited.train).endswith("a different last document\n" + data.EOT)
    assert capped.meta["text_bytes"] == 500


def _prepare_in_child(cfg, barrier, results):
    barrier.wait()  # both processes enter prepare() together, like torchrun ranks
    corpus = data.prepare(cfg, seq_len=8)
    results.put((str(corpus.path), corpus.meta["reused"], hashlib.sha256(all_tokens(corpus).tobytes()).hexdigest()))


def test_concurrent_prepare_builds_once(tmp_path):
    cfg = config(tmp_path, write_jsonl(tmp_path / "d.jsonl", DOCS * 50))
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_prepare_in_child, args=(cfg, barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    (path_a, reused_a, hash_a), (path_b, reused_b, hash_b) = outcomes
    assert path_a == path_b and hash_a == hash_b
    assert sorted([reused_a, reused_b]) == [False, True]  # one built, the other waited and reused
    assert not [p.name for p in Path(path_a).iterdir() if ".tmp" in p.name]


# --- Sources ---

def test_json_parquet_text_folder_and_glob_sources_agree(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    write_jsonl(tmp_path / "d.jsonl", field="body")
    pq.write_table(pa.table({"body": DOCS}), tmp_path / "d.parquet")
    (tmp_path / "texts").mkdir()
    for i, doc in enumerate(DOCS):  # zero-padded, so sorted order is document order
        (tmp_path / "texts" / f"{i:02d}.txt").write_text(doc)
    (tmp_path / "texts" / ".hidden").write_text("editor junk that must not be read")
    sources = {"json": config(tmp_path, tmp_path / "d.jsonl", text_field="body"),
               "parquet": config(tmp_path, tmp_path / "d.parquet", text_field="body"),
               "text folder": config(tmp_path, tmp_path / "texts"),
               "text glob": config(tmp_path, tmp_path / "texts" / "*.txt", format="text")}
    for name, cfg in sources.items():
        data.check_config(cfg)
        corpus = data.prepare(cfg, seq_len=8)
        assert corpus.decode(all_tokens(corpus)) == STREAM, name
        assert corpus.meta["documents"] == len(DOCS), name


def test_wrong_text_field_names_the_columns(tmp_path):
    with pytest.raises(ConfigError, match=r"no column 'content'; the dataset has (text, id|id, text)\.") as err:
        data.prepare(config(tmp_path, write_jsonl(tmp_path / "d.jsonl"), text_field="content"), seq_len=8)
    assert err.value.key == "data.text_field"


def test_stdlib_corpus_records_python_version_and_content_hash(tmp_path):
    cap = 20_000
    corpus = data.prepare(config(tmp_path, "stdlib", max_bytes=cap), seq_len=32)
    # The reference: the first `cap` bytes of the sorted *.py files, computed independently.
    root = Path(sysconfig.get_paths()["stdlib"])
    names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                   if "site-packages" not in p.relative_to(root).parts)
    raw = b""
    for name in names:
        raw += (root / name).read_bytes()
        if len(raw) >= cap:
            break
    raw = raw[:cap]
    meta = corpus.meta
    assert meta["python_version"] == platform.python_version()
    assert meta["content_hash"] == hashlib.sha256(raw).hexdigest() and meta["bytes"] == cap
    decoded = corpus.decode(all_tokens(corpus))
    assert decoded.replace(data.EOT, "") == raw.decode("utf-8", errors="replace")
    assert decoded.count(data.EOT) == meta["documents"] == meta["files"]
    json.dumps(meta)  # run.json stores it


def test_hf_tokenizer_from_a_local_path(tmp_path):
    from transformers import PreTrainedTokenizerFast
    trained = data.BPETokenizer.train(DOCS, vocab_size=300).tok
    PreTrainedTokenizerFast(tokenizer_object=trained, eos_token=data.EOT).save_pretrained(tmp_path / "tok")
    corpus = data.prepare(config(tmp_path, write_jsonl(tmp_path / "d.jsonl"), tokenizer=str(tmp_path / "tok")), seq_len=8)
    trained.encode_special_tokens = True
    eot = trained.token_to_id(data.EOT)
    expected = [i for d in DOCS for i in trained.encode(d, add_special_tokens=False).ids + [eot]]
    assert all_tokens(corpus).tolist() == expected
    assert corpus.vocab_size == trained.get_vocab_size() and corpus.decode(all_tokens(corpus)) == STREAM


# --- Config checks ---

def test_check_config_rejects_bad_input_without_loading(tmp_path):
    def key_of(**overrides):
        with pytest.raises(ConfigError) as err:
            data.check_config(config(tmp_path, **{"source": "stdlib", **overrides}))
        return err.value.key
    assert key_of(source=str(tmp_path / "missing.jsonl")) == "data.source"
    assert key_of(source=str(tmp_path / "nothing" / "*.parquet")) == "data.source"
    assert key_of(source="./not_here") == "data.source"
    assert key_of(format="csv") == "data.format"
    assert key_of(val_fraction=1.0) == "data.val_fraction"
    assert key_of(max_bytes=0) == "data.max_bytes"
    assert key_of(tokenizer="bpe", bpe_vocab_size=100) == "data.bpe_vocab_size"
    assert key_of(tokenizer=str(tmp_path / "no_tokenizer")) == "data.tokenizer"
    assert key_of(pipeline="fast") == "data.pipeline"
    assert key_of(prefetch_async=True, prefetch=0) == "data.prefetch"
    write_jsonl(tmp_path / "a.jsonl")
    (tmp_path / "b.txt").write_text("text")
    assert key_of(source=str(tmp_path / "*")) == "data.format"  # mixed json and text
    for fine in ("stdlib", "roneneldan/TinyStories", "wikitext", str(tmp_path / "a.jsonl")):
        data.check_config(config(tmp_path, fine, tokenizer="gpt2"))


def test_an_unreachable_hub_dataset_is_a_one_line_config_error(tmp_path):
    with pytest.raises(ConfigError) as err:
        data.prepare(config(tmp_path, "megarepro-no-such-org/no-such-dataset"), seq_len=8)
    assert err.value.key == "data.source" and "\n" not in str(err.value)


# --- Sampler ---

def test_sampler_is_deterministic_and_each_epoch_is_a_permutation():
    N, B = 10, 4
    first_batch = sampling.Sampler(N, B, seed=7).next_indices()
    a, b = sampling.Sampler(N, B, seed=7), sampling.Sampler(N, B, seed=7)
    steps_a = [a.next_indices() for _ in range(10)]
    steps_b = [b.next_indices() for _ in range(10)]
    assert all(np.array_equal(x, y) for x, y in zip(steps_a, steps_b))
    flat = np.concatenate(steps_a)  # 40 indices = 4 epochs; batches straddle epoch boundaries
    np.testing.assert_array_equal(flat[:B], first_batch)
    for epoch in range(4):
        np.testing.assert_array_equal(flat[epoch * N:(epoch + 1) * N],
                                      np.random.default_rng([7, epoch]).permutation(N))
    assert not np.array_equal(flat[:N], flat[N:2 * N])  # a new order each epoch
    other = np.concatenate([sampling.Sampler(N, B, seed=8).next_indices() for _ in range(10)])
    assert not np.array_equal(flat, other)


def test_dp_ranks_together_read_the_single_process_global_batch():
    N, B = 23, 6  # N not a multiple of B: batches wrap across epochs
    single = sampling.Sampler(N, B, seed=1)
    ranks = [sampling.Sampler(N, B, dp_rank=r, dp_size=2, seed=1) for r in range(2)]
    for _ in range(12):
        parts = [s.next_indices() for s in ranks]
        assert [len(p) for p in parts] == [3, 3]
        np.testing.assert_array_equal(np.concatenate(parts), single.next_indices())
    with pytest.raises(ValueError):
        sampling.Sampler(N, 5, dp_size=2)


def test_sampler_state_restores_the_following_batches():
    a = sampling.Sampler(17, 4, seed=2)
    for _ in range(5):
        a.next_indices()
    state = a.state_dict()
    expected = [a.next_indices() for _ in range(6)]
    b = sampling.Sampler(17, 4, seed=2)
    b.load_state_dict(state)
    assert all(np.array_equal(x, b.next_indices()) for x in expected)
    with pytest.raises(ValueError, match="data or seed changed"):
        sampling.Sampler(17, 4, seed=3).load_state_dict(state)


# --- Loader ---

def _loader(corpus, prefetch, seed=5, **kw):
    n = corpus.num_sequences("train", 16)
    return sampling.Loader(corpus, "train", 16, sampling.Sampler(n, 4, seed=seed, **kw), prefetch=prefetch)


def test_prefetch_gives_the_same_stream_and_the_consumed_state(jsonl_corpus):
    sync, ahead = _loader(jsonl_corpus, prefetch=0), _loader(jsonl_corpus, prefetch=3)
    for step in range(7):
        assert torch.equal(next(sync), next(ahead))
        # The thread has run ahead, yet the state is what the loop consumed.
        assert ahead.state_dict() == sync.state_dict() == {"sampler": {"consumed": 4 * (step + 1), "seed": 5,
                                                                       "num_sequences": sync.sampler.num_sequences}}
    ahead.close()
    assert ahead.sampler.consumed == 28  # prefetched batches were given back
    assert torch.equal(next(ahead), next(sync))  # iterating after close() resumes where it stopped
    ahead.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_loader_resume_is_bit_identical(jsonl_corpus, prefetch):
    run = _loader(jsonl_corpus, prefetch)
    for _ in range(5):
        next(run)
    state = json.loads(json.dumps(run.state_dict()))  # survives a checkpoint round trip
    uninterrupted = [next(run) for _ in range(6)]
    run.close()
    resumed = _loader(jsonl_corpus, prefetch)
    resumed.load_state_dict(state)
    for stream, again in zip(uninterrupted, (next(resumed) for _ in range(6))):
        assert torch.equal(stream, again)
    resumed.close()


def test_dp_loaders_concatenate_to_the_single_process_batch(jsonl_corpus):
    single = _loader(jsonl_corpus, prefetch=0)
    ranks = [_loader(jsonl_corpus, prefetch=1, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(4):
        assert torch.equal(torch.cat([next(r) for r in ranks]), next(single))
    for r in ranks:
        r.close()


def test_eval_batches_are_fixed_held_out_and_dp_sliced(jsonl_corpus):
    first = sampling.eval_batches(jsonl_corpus, 16, n_batches=2, global_batch=4)
    again = sampling.eval_batches(jsonl_corpus, 16, n_batches=2, global_batch=4)
    assert len(first) == 2 and all(torch.equal(a, b) for a, b in zip(first, again))
    val_rows = torch.from_numpy(jsonl_corpus.sequences("val", 16).astype(np.int64))
    for stream in first:  # every row is a val sequence, never a training one
        for row in stream.long():
            assert any(torch.equal(row, v) for v in val_rows)
    halves = [sampling.eval_batches(jsonl_corpus, 16, 2, 4, dp_rank=r, dp_size=2) for r in range(2)]
    for b in range(2):
        assert torch.equal(torch.cat([halves[0][b], halves[1][b]]), first[b])


# --- Who reads: one reader per TP group, none on a middle pipeline stage (spawned gloo ranks) ---

def _loaders_on_ranks(rank, world, port, path, meta, layout, out):
    """One gloo rank: the megascale loader of `layout` ("tp" or "pp") and, beside it, the naive
    loader every rank would have on one process; writes what each handed out and how often each read."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    sent = []  # what each broadcast put on the wire: (dtype, shape)
    broadcast = dist.broadcast
    dist.broadcast = lambda tensor, *a, **kw: (sent.append((str(tensor.dtype), list(tensor.shape))), broadcast(tensor, *a, **kw))[1]
    try:
        corpus = data.Corpus(Path(path), meta, 0.2)
        n = corpus.num_sequences("train", 16)
        cfg = data.DataConfig(pipeline="megascale", prefetch=2)
        tp = dict(tp_group=dist.group.WORLD, tp_rank=rank) if layout == "tp" else dict(pp_rank=rank, pp=world)
        build = lambda: sampling.train_loader(corpus, cfg, 16, sampling.Sampler(n, 4, seed=5), **tp)
        shared, naive = build(), sampling.Loader(corpus, "train", 16, sampling.Sampler(n, 4, seed=5), prefetch=0)
        got, want = [next(shared) for _ in range(3)], [next(naive) for _ in range(3)]
        state = json.loads(json.dumps(shared.state_dict()))  # a checkpoint here ...
        got += [next(shared) for _ in range(3)]
        want += [next(naive) for _ in range(3)]
        reads = getattr(shared, "loader", shared).reads
        shared.close()
        resumed = build()  # ... resumed: the same next batches
        resumed.load_state_dict(state)
        again = [next(resumed) for _ in range(3)]
        resumed.close()
        torch.save({"got": got, "want": want, "again": again, "reads": reads, "sent": sent, "state": state},
                   Path(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_one_reader_per_tp_group_broadcasts_a_narrow_stream(jsonl_corpus, tmp_path):
    """tp2 with data.pipeline=megascale: rank 0 reads (prefetching), rank 1 reads nothing, and
    both get bit for bit the batches they would have read themselves, across a resume. The
    broadcast is one [4, 17] uint16 stream (as its bytes), not int64 inputs and targets."""
    from conftest import spawn
    spawn(_loaders_on_ranks, 2, str(jsonl_corpus.path), jsonl_corpus.meta, "tp", str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r, out in enumerate(ranks):
        assert all(g.dtype == torch.uint16 and g.shape == (4, 17) and torch.equal(g, w)
                   for g, w in zip(out["got"], out["want"])), r
        assert all(torch.equal(a, w) for a, w in zip(out["again"], out["want"][3:])), r
        assert out["sent"] == [("torch.uint8", [4, 2 * 17])] * 9, r  # 2 bytes a token
    assert [out["reads"] for out in ranks][1] == 0 and ranks[0]["reads"] >= 6
    assert ranks[0]["state"] == ranks[1]["state"]


def test_a_middle_pipeline_stage_never_reads(jsonl_corpus, tmp_path):
    """pp3: the first and last stages read their batches (the naive ones, bit for bit); the
    middle stage reads none and receives none, yet its data position is theirs, so all resume alike."""
    from conftest import spawn
    spawn(_loaders_on_ranks, 3, str(jsonl_corpus.path), jsonl_corpus.meta, "pp", str(tmp_path))
    first, middle, last = (torch.load(tmp_path / f"rank{r}.pt") for r in range(3))
    for out in (first, last):
        assert all(torch.equal(g, w) for g, w in zip(out["got"] + out["again"], out["want"] + out["want"][3:]))
        assert out["reads"] >= 6 and out["sent"] == []
    assert middle["reads"] == 0 and middle["sent"] == []
    assert all(g.shape == (4, 17) for g in middle["got"])  # the shape the schedule asks, no tokens
    assert first["state"] == middle["state"] == last["state"]


def test_a_stream_is_as_narrow_as_the_vocabulary_and_crosses_the_wire_intact():
    """uint16 up to 2**16 ids (GPT-2's 50257), int32 above (Llama 3's 128256); a uint16 stream is
    broadcast as its bytes (no collective library has a 16-bit integer) and read back unchanged."""
    assert sampling.token_dtype(50257) == sampling.token_dtype(2**16) == torch.uint16
    assert sampling.token_dtype(2**16 + 1) == sampling.token_dtype(128256) == torch.int32
    rows = np.array([[0, 1, 65535], [50256, 7, 2]], dtype=np.uint32)
    for dtype in (torch.uint16, torch.int32):
        stream = sampling._rows_to_stream(rows, dtype, pin_memory=False)
        wire = sampling.wire_view(stream)
        assert wire.dtype in (torch.uint8, torch.int32) and wire.element_size() * wire.shape[1] == 3 * stream.element_size()
        inputs, targets = sampling.to_device(wire.view(dtype), torch.device("cpu"))
        assert inputs.tolist() == rows[:, :-1].tolist() and targets.tolist() == rows[:, 1:].tolist()
