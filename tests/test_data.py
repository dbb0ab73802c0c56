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


def test_a_rank_of_a_larger_job_opens_the_build_without_reading_the_source(tmp_path, monkeypatch):
    """A rank of a job of 2+ ranks finds the build by the data.* keys alone and never reads the
    source (256 reads of shared storage at 256 ranks), nor builds where there is no build."""
    cfg = config(tmp_path, write_jsonl(tmp_path / "d.jsonl"))
    built = data.prepare(cfg, seq_len=8)
    monkeypatch.setattr(data.sources, "plan", lambda *a: pytest.fail("a rank looked at the source"))
    monkeypatch.setattr(data.build, "build", lambda *a, **k: pytest.fail("a rank built"))
    rank = data.prepare(cfg, seq_len=8, world=2)
    assert rank.path == built.path and rank.meta["reused"]
    np.testing.assert_array_equal(rank.train, built.train)
    elsewhere = config(tmp_path, write_jsonl(tmp_path / "d.jsonl"), cache_dir=str(tmp_path / "node2"))
    with pytest.raises(ConfigError, match=r"never builds. Fix: build it first: python -m corpus build .*data.cache_dir="):
        data.prepare(elsewhere, seq_len=8, world=2)


def test_changed_input_invalidates_the_cache(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl")
    base = data.prepare(config(tmp_path, source), seq_len=8)
    write_jsonl(source, DOCS[:-1] + ["a different last document\n"])
    edited = data.prepare(config(tmp_path, source), seq_len=8)
    capped = data.prepare(config(tmp_path, source, max_bytes=500), seq_len=8)
    bpe = data.prepare(config(tmp_path, source, tokenizer="bpe", bpe_vocab_size=300), seq_len=8)
    # The edited source is built again in the same folder (named by the data.* keys); a cap or
    # another tokenizer is another build.
    assert edited.path == base.path and len({base.path, capped.path, bpe.path}) == 3
    assert not any(c.meta["reused"] for c in (edited, capped, bpe))
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
    with pytest.raises(ConfigError, match="data or seed changed") as err:  # a changed corpus or seq_len too
        sampling.Sampler(18, 4, seed=2).load_state_dict(state)
    assert err.value.key == "resume" and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="data or seed changed"):
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

def _loaders_on_ranks(rank, world, port, path, manifest, layout, out):
    """One gloo rank: the megascale loader of `layout` ("tp" or "pp") and, beside it, the naive
    loader every rank would have on one process; writes what each handed out and how often each read."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    sent = []  # what each broadcast put on the wire: (dtype, shape)
    broadcast = dist.broadcast
    dist.broadcast = lambda tensor, *a, **kw: (sent.append((str(tensor.dtype), list(tensor.shape))), broadcast(tensor, *a, **kw))[1]
    try:
        corpus = data.Corpus(Path(path), manifest, 0.2)
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
    spawn(_loaders_on_ranks, 2, str(jsonl_corpus.path), jsonl_corpus.manifest, "tp", str(tmp_path))
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
    spawn(_loaders_on_ranks, 3, str(jsonl_corpus.path), jsonl_corpus.manifest, "pp", str(tmp_path))
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


# --- The build (corpus/): workers, SLURM-array parts, resume, several shards ---

import corpus.__main__ as corpus_cli  # noqa: E402
from corpus import build as corpus_build, indexed  # noqa: E402


def many_files(folder: Path, n: int = 6) -> Path:
    folder.mkdir()
    for i in range(n):  # zero-padded: sorted order is document order
        write_jsonl(folder / f"part{i:02d}.jsonl", [f"file {i}, document {j}: " + d for j, d in enumerate(DOCS)])
    return folder


def built_files(cfg) -> dict:
    """Every shard's bytes and the manifest (less the command, which names the cache) of a build."""
    folder = corpus_build.directory(cfg)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.pop("command")
    return {"manifest": manifest, **{p.name: p.read_bytes() for p in sorted(folder.glob("shard_*")) if ".verified" not in p.name}}


SMALL_UNITS = dict(tokenizer="bpe", bpe_vocab_size=300, shard_bytes=4000)  # several units, several shards each


def test_two_workers_build_the_bytes_of_one(tmp_path):
    source = many_files(tmp_path / "src")
    one = config(tmp_path, source, cache_dir=str(tmp_path / "one"), **SMALL_UNITS)
    two = config(tmp_path, source, cache_dir=str(tmp_path / "two"), **SMALL_UNITS)
    corpus_build.build(one, workers=1)
    corpus_build.build(two, workers=2)
    files = built_files(one)
    assert len(files["manifest"]["shards"]) > 6 and files == built_files(two)


def test_sharded_builds_and_merge_equal_one_job(tmp_path):
    """Two SLURM-array jobs (--shard 0/2, 1/2) and --merge, through the command line, build what
    one job builds; before the merge a job of 2 ranks finds no build."""
    source = many_files(tmp_path / "src")
    one = config(tmp_path, source, cache_dir=str(tmp_path / "one"), **SMALL_UNITS)
    corpus_build.build(one)
    keys = [f"data.source={source}", "data.tokenizer=bpe", "data.bpe_vocab_size=300", "data.shard_bytes=4000",
            f"data.cache_dir={tmp_path / 'parts'}", "--workers", "1", "--quiet"]
    parts = config(tmp_path, source, cache_dir=str(tmp_path / "parts"), **SMALL_UNITS)
    for i in range(2):
        assert corpus_cli.main(["build", *keys, "--shard", f"{i}/2"]) == 0
        assert data.build_problem(parts, world=2, model_vocab=300).endswith(
            f"never builds. Fix: build it first: {corpus_build.command(parts)}")
    assert corpus_cli.main(["build", *keys, "--merge"]) == 0
    assert built_files(parts) == built_files(one)
    assert data.build_problem(parts, world=2, model_vocab=300) is None


def test_a_killed_build_keeps_its_finished_units(tmp_path):
    cfg = config(tmp_path, many_files(tmp_path / "src"), **SMALL_UNITS)
    corpus_build.build(cfg)
    folder, whole = corpus_build.directory(cfg), built_files(cfg)
    kept = {p.name: p.stat().st_mtime_ns for p in folder.glob("shard_00000_*")}
    (folder / "manifest.json").unlink()  # killed after unit 0, during unit 1: its shards half-written
    (folder / "unit_00001.json").unlink()
    next(folder.glob("shard_00001_*.bin")).write_bytes(b"partial")
    corpus_build.build(cfg)
    assert built_files(cfg) == whole
    assert {p.name: p.stat().st_mtime_ns for p in folder.glob("shard_00000_*")} == kept  # not redone


def test_several_shards_read_as_one_stream(tmp_path):
    source = many_files(tmp_path / "src")
    whole = data.prepare(config(tmp_path, source, tokenizer="bytes", val_fraction=0.1), seq_len=16)
    sharded = data.prepare(config(tmp_path, source, tokenizer="bytes", val_fraction=0.1, shard_bytes=3000), seq_len=16)
    assert whole.meta["shards"] == 1 and sharded.meta["shards"] > 6
    np.testing.assert_array_equal(np.asarray(sharded.train), whole.train)
    np.testing.assert_array_equal(np.asarray(sharded.val), whole.val)
    rows, expected = sharded.sequences("train", 16), whole.sequences("train", 16)
    picks = np.random.default_rng(0).permutation(len(expected))[:200]  # rows across shard boundaries too
    assert len(rows) == len(expected)
    np.testing.assert_array_equal(rows[picks], expected[picks])
    with pytest.raises(IndexError):  # the row past the train split would be the val split's tokens
        rows[[0, len(rows)]]
    assert sharded.decode(np.asarray(sharded.train)) == whole.decode(whole.train)
    shard = indexed.IndexedShard(sharded.path / sharded.shards[1])  # the reader: header, tokens, documents
    first = sharded.manifest["shards"][0]["tokens"]  # where shard 1 starts in the stream
    assert shard.header["vocab_size"] == 257 and len(shard) == sharded.manifest["shards"][1]["tokens"]
    np.testing.assert_array_equal(shard.document(0), whole.train[first: first + len(shard.document(0))])
    assert shard.document(0)[-1] == whole.eot_id and (shard.tokens == whole.eot_id).sum() == shard.header["documents"]


# --- Bad input: one line naming the file and the fix ---

def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text and text.startswith("config error: ") and ". Fix: " in text, text
    return text


def test_the_check_catches_a_flipped_byte_and_a_truncated_shard(tmp_path):
    cfg = config(tmp_path, write_jsonl(tmp_path / "d.jsonl"))
    corpus = data.prepare(cfg, seq_len=8)
    corpus.verify()
    shard = corpus.path / f"{corpus.shards[0]}.bin"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    with pytest.raises(ConfigError) as err:
        data.open_built(cfg).verify()
    assert f"{shard} fails its checksum" in one_line(err) and "python -m corpus build" in one_line(err)
    shard.write_bytes(bytes(raw[:-2]))
    with pytest.raises(ConfigError, match=r"holds \d+ bytes, not the \d+ of its \d+ tokens") as err:
        data.open_built(cfg)
    assert str(shard) in one_line(err)


def test_a_shard_of_another_vocabulary_is_refused(tmp_path):
    cfg = config(tmp_path, write_jsonl(tmp_path / "d.jsonl"))
    corpus = data.prepare(cfg, seq_len=8)
    prefix = corpus.path / corpus.shards[0]
    other = tmp_path / "other"
    writer = indexed.ShardWriter(other, vocab_size=50257)
    writer.add(np.asarray(corpus.train), np.asarray([len(corpus.train)]))
    writer.finish()
    Path(f"{prefix}.idx").write_bytes(Path(f"{other}.idx").read_bytes())
    with pytest.raises(ConfigError) as err:
        data.open_built(cfg).verify()
    assert f"{prefix}.idx was written for a vocabulary of 50257 tokens" in one_line(err)


def test_a_truncated_manifest_is_one_line(tmp_path):
    cfg = config(tmp_path, write_jsonl(tmp_path / "d.jsonl"))
    manifest = data.prepare(cfg, seq_len=8).path / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    with pytest.raises(ConfigError) as err:
        data.prepare(cfg, seq_len=8, world=2)
    assert f"the corpus manifest {manifest} is unreadable" in one_line(err)
    assert data.build_problem(cfg, 2, 257) == str(err.value) and data.build_problem(cfg, 1, 257) is None
    data.prepare(cfg, seq_len=8)  # one process builds it again


def test_an_empty_source_file_is_one_line(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError) as err:
        data.prepare(config(tmp_path, tmp_path / "empty.txt"), seq_len=8)
    assert "'" + str(tmp_path / "empty.txt") + "' contains no text" in one_line(err)


def test_a_damaged_json_or_parquet_file_is_one_line(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + '{"text": "cut he')
    with pytest.raises(ConfigError) as err:
        data.prepare(config(tmp_path, tmp_path / "a.jsonl"), seq_len=8)
    assert f"{tmp_path / 'a.jsonl'}, line 2, is not JSON" in one_line(err)
    (tmp_path / "b.parquet").write_bytes(b"PAR1 truncated")
    with pytest.raises(ConfigError) as err:
        data.prepare(config(tmp_path, tmp_path / "b.parquet"), seq_len=8)
    assert f"{tmp_path / 'b.parquet'} is not a readable parquet file" in one_line(err)


def test_token_ids_beyond_the_model_vocabulary_stop_the_job(tmp_path):
    cfg = config(tmp_path, write_jsonl(tmp_path / "d.jsonl"))
    data.prepare(cfg, seq_len=8)
    assert data.build_problem(cfg, 2, model_vocab=257) is None
    line = data.build_problem(cfg, 2, model_vocab=200)
    assert line.startswith("config error: model.vocab_size: 200 is smaller than the corpus's vocabulary of 257")
    assert line.endswith("Fix: set model.vocab_size>=257") and "\n" not in line


def test_a_job_of_two_ranks_without_a_build_stops_at_once(tmp_path):
    from conftest import SMALL, run_train
    import time
    started = time.monotonic()
    proc = run_train(tmp_path / "run", SMALL + ["train.max_steps=1"], tmp_path / "empty_cache", nproc=2, check=False)
    assert proc.returncode == 2 and time.monotonic() - started < 60
    lines = [l for l in proc.stderr.splitlines() if l.startswith("config error")]
    assert len(lines) == 1 and "never builds. Fix: build it first: python -m corpus build " in lines[0]
    assert "data.max_bytes=1500000" in lines[0] and "data.bpe_vocab_size=512" in lines[0]
    assert not (tmp_path / "empty_cache" / "corpus").exists()  # nothing built, nothing started


def test_a_ranks_start_up_file_system_calls_grow_with_the_shards_not_the_ranks(tmp_path, monkeypatch):
    """What a rank of a W-rank job opens and stats to start (its build check, the config's data
    check, the manifest, a memory map per shard, its share of the checksum markers), counted as
    clustermodel/rank_costs.py models it: O(shards), and O(1) in the number of ranks."""
    from clustermodel import rank_costs
    cfg = config(tmp_path, many_files(tmp_path / "src"), tokenizer="bytes", shard_bytes=3000)
    shards = data.prepare(cfg, seq_len=8).meta["shards"]
    data.open_built(cfg).verify()  # the markers a first start leaves
    calls = []
    for name in ("stat", "fstat"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, _real=real, _name=name, **k: (
            calls.append((_name, a[0])) if counting else None) or _real(*a, **k))
    sys.addaudithook(lambda event, args: calls.append(("open", args[0])) if event == "open" and counting else None)
    for world in (2, 8, 64):
        for rank in (0, 1, world - 1):
            global counting
            calls.clear()
            counting = True
            assert data.build_problem(cfg, world, 257) is None
            data.check_config(cfg, world)
            data.prepare(cfg, seq_len=8, world=world).verify(rank, world)
            counting = False
            assert len(calls) == rank_costs.corpus_start_fs_calls(shards, rank, world), (world, rank, "\n".join(map(str, calls)))


counting = False


def test_resuming_with_another_seq_len_is_one_line(tmp_path, cache_dir):
    """The checkpoint's data position counts sequences of its corpus at its seq_len: a resume
    where either changed stops before training, with one line naming resume and the fix."""
    from conftest import SMALL, run_train
    import checkpoint
    saved = tmp_path / "saved"
    run_train(saved, SMALL + ["train.max_steps=2", "checkpoint.interval=2"], cache_dir)
    folder = checkpoint.step_dir(saved / "checkpoints", 2)
    proc = run_train(tmp_path / "resumed", SMALL + ["train.max_steps=3", "train.seq_len=32", f"resume={folder}"],
                     cache_dir, check=False)
    lines = [l for l in proc.stderr.splitlines() if l.startswith("config error")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0].startswith("config error: resume: the checkpoint's data position is for seed=")
    assert "Fix: resume with the corpus, train.seq_len and train.seed it was saved with, or resume=none" in lines[0]


def test_a_corpus_smaller_than_one_global_batch_warns_with_the_repeat_count(tmp_path, cache_dir):
    """5 sequences for a global batch of 8: the run trains, and says each step repeats sequences
    (1.6 times each) rather than handing out duplicates silently."""
    from conftest import run_train
    source = tmp_path / "small.jsonl"
    source.write_text(json.dumps({"text": "x" * 330}) + "\n")  # 331 tokens: 5 sequences of 64 (+1)
    proc = run_train(tmp_path / "run", ["model=tiny", "model.vocab_size=257", "data.tokenizer=bytes",
                                        f"data.source={source}", "data.val_fraction=0", "train.seq_len=64",
                                        "train.batch_size=8", "train.max_steps=2", "train.eval_interval=0",
                                        "logging.wandb.mode=disabled", "logging.progress=false"], cache_dir)
    out = proc.stdout + proc.stderr
    assert "the training split holds 5 sequences of 64 tokens, fewer than one global batch of 8" in out, out[-2000:]
    assert "(1.6 times each)" in out
