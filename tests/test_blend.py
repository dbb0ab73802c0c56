"""corpus/blend.py: weighted blends drawn by Megatron's rule, the shared memory-mapped stream index,
held-out batches from every source, and a blended run that resumes exactly.

The corpora are a few KB of bytes-tokenized text written to tmp_path; nothing is downloaded."""
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import dataclasses
import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

import checkpoint
import config
import data
import sampling
from conftest import SMALL, read_metrics, run_train
from corpus import blend, build
from errors import ConfigError


def megatron_sources(weights, count: int) -> np.ndarray:
    """Megatron-LM's build_blending_indices as its C++ loop states it (argmax of
    weight * max(i, 1) - drawn, the first on a tie), in exact arithmetic."""
    w = [Fraction(repr(x)) / sum(Fraction(repr(y)) for y in weights) for x in weights]
    drawn, out = [0] * len(w), []
    for i in range(count):
        lags = [wj * max(i, 1) - d for wj, d in zip(w, drawn)]
        j = lags.index(max(lags))
        out.append(j)
        drawn[j] += 1
    return np.array(out)


def write_docs(path: Path, letter: str, n: int = 40) -> Path:
    """A source whose every few tokens hold `letter`, so a row tells which source it came from, and
    numbers, so that no two rows are alike."""
    path.write_text("".join(json.dumps({"text": " ".join(f"{letter}{i}.{k}" for k in range(8)) + "\n"}) + "\n"
                            for i in range(n)))
    return path


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("blend")
    files = [write_docs(tmp / "a.jsonl", "a"), write_docs(tmp / "b.jsonl", "b", 60)]
    cfg = data.DataConfig(source="stdlib", tokenizer="bytes", val_fraction=0.2, cache_dir=str(tmp / "cache"),
                          shard_bytes=1024,  # several shards a source: rows are read across them
                          sources=[data.BlendSource(str(files[0]), 0.3), data.BlendSource(str(files[1]), 0.7)])
    corpora = [data.prepare(c, seq_len=16) for c in blend.source_configs(cfg)]
    assert all(len(c.shards) > 1 for c in corpora)
    return blend.combine(corpora, cfg), tmp / "cache", files


def source_of_row(row) -> int:
    letters = set(bytes(int(t) for t in np.asarray(row) if t < 256).decode()) & {"a", "b"}
    assert len(letters) == 1, letters
    return "ab".index(letters.pop())


def test_the_source_rule_is_megatrons_and_keeps_every_prefix_within_one_sample():
    rng = np.random.default_rng(0)
    for k in (2, 3, 5):
        weights = [float(w) for w in rng.integers(1, 40, k)] + [0.25]
        np.testing.assert_array_equal(blend.sources_of(blend.weight_units(weights), 0, 2000),
                                      megatron_sources(weights, 2000))
    units = blend.weight_units([0.3, 0.7])
    assert units == (3, 7) and blend.weight_units([2, 6]) == (1, 3)
    assert blend.weight_units([0.1234567, 0.8765433]) == (123457, 876543)  # 10^7 units: millionths
    src = blend.sources_of(units, 0, 5000)
    drawn = np.cumsum(src == 0)
    n = np.arange(1, 5001)
    assert np.all(np.abs(drawn - 0.3 * n) < 1)         # every prefix within one sample of its share
    assert np.all(drawn[9::10] == 3 * n[9::10] // 10)  # exactly 3 in every 10
    np.testing.assert_array_equal(blend.sources_of(units, 1234, 4321), src[1234:4321])  # any window alone


def test_a_blend_draws_its_sources_at_their_weights_each_epoch_shuffled(two_sources):
    corpus, cache, _ = two_sources
    sizes = corpus.sizes("train", 16)
    index = blend.sample_index(corpus, 16, seed=4, samples=1000, cache_dir=cache)
    rows = index.rows(0, 1000)
    from_a = rows < sizes[0]
    assert np.all(np.abs(np.cumsum(from_a) - 0.3 * np.arange(1, 1001)) < 1)
    a_rows = rows[from_a]  # source a's draws: whole epochs, each a permutation of its rows
    for e in range(len(a_rows) // sizes[0]):
        epoch = a_rows[e * sizes[0]:(e + 1) * sizes[0]]
        assert sorted(epoch) == list(range(sizes[0]))
    assert not np.array_equal(a_rows[:sizes[0]], a_rows[sizes[0]:2 * sizes[0]])
    batch = corpus.sequences("train", 16)[rows[:20]]  # and the gathered rows are those sources' text
    assert [source_of_row(r) for r in batch] == [int(not a) for a in from_a[:20]]


def test_the_index_is_one_memory_mapped_file_that_every_rank_shares(two_sources, tmp_path):
    corpus, _, _ = two_sources
    samples = 1000
    ranks = [sampling.Sampler(blend.sample_index(corpus, 16, 0, samples, tmp_path), 8, dp_rank=r, dp_size=2)
             for r in range(2)]
    files = sorted(tmp_path.glob("sample-index-*.npy"))
    assert len(files) == 1 and not list(tmp_path.glob("*.tmp*"))  # built once, renamed into place
    for s in ranks:  # a rank maps the file; it holds no array the size of the corpus
        assert isinstance(s.index.array, np.memmap) and Path(s.index.array.filename).resolve() == files[0].resolve()
        assert s.index.array.dtype == np.int32 and len(s.index.array) == samples
        assert not any(isinstance(v, np.ndarray) and not isinstance(v, np.memmap) for v in vars(s.index).values())
    assert files[0].stat().st_size < samples * 4 + 256  # int32 rows plus the .npy header
    assert blend.row_dtype(2**31 - 1) == np.int32 and blend.row_dtype(2**31) == np.int64
    mtime = files[0].stat().st_mtime_ns
    blend.sample_index(corpus, 16, 0, samples, tmp_path)  # a third opener maps, never rebuilds
    assert files[0].stat().st_mtime_ns == mtime


def test_reading_past_the_index_continues_the_same_stream(two_sources, tmp_path):
    corpus, _, _ = two_sources
    short = blend.sample_index(corpus, 16, 1, samples=100, cache_dir=tmp_path)
    longer = blend.sample_index(corpus, 16, 1, samples=400, cache_dir=None)
    np.testing.assert_array_equal(short.rows(90, 30), longer.rows(90, 30))  # maps a longer index
    assert short.samples >= 200 and isinstance(short.array, np.memmap)


def test_a_blended_stream_resumes_across_a_changed_batch_and_dp_degree(two_sources, tmp_path):
    corpus, _, _ = two_sources
    index = lambda: blend.sample_index(corpus, 16, 2, samples=64, cache_dir=tmp_path)
    single = sampling.Sampler(index(), 2)
    stream = np.concatenate([single.next_indices() for _ in range(60)])
    first = [sampling.Sampler(index(), 4, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(3):
        for s in first:
            s.next_indices()
    state = json.loads(json.dumps(first[0].state_dict()))  # through a checkpoint
    assert state["blend"] == [[n, u, s] for n, u, s in zip(corpus.names, (3, 7), corpus.sizes("train", 16))]
    after = [sampling.Sampler(index(), 6, dp_rank=r, dp_size=3) for r in range(3)]
    for s in after:
        s.load_state_dict(state)
    for step in range(4):
        got = np.concatenate([s.next_indices() for s in after])
        np.testing.assert_array_equal(got, stream[12 + 6 * step: 18 + 6 * step])
    other = sampling.Sampler(blend.SampleIndex(corpus.sizes("train", 16), (1, 1), 2, 64, None, corpus.names), 2)
    with pytest.raises(ValueError, match="data or seed changed"):
        other.load_state_dict(state)


def test_validation_batches_come_from_every_sources_held_out_split(two_sources):
    corpus, _, _ = two_sources
    batches = sampling.eval_batches(corpus, 16, n_batches=2, global_batch=10)
    rows = lambda c, split: c.sequences(split, 16)[np.arange(c.num_sequences(split, 16))]
    val, train = ([rows(c, split) for c in corpus.corpora] for split in ("val", "train"))
    sources = []
    for stream in batches:  # [local batch, seq_len + 1] token streams: inputs and targets shifted views
        for row in stream.long():
            full = row.numpy()
            j = source_of_row(full)
            assert any(np.array_equal(full, v) for v in val[j])
            assert not any(np.array_equal(full, t) for t in train[j])  # (a row of every split would do)
            sources.append(j)
    assert sources.count(0) == 6 and sources.count(1) == 14  # 0.3 and 0.7 of 20
    halves = [sampling.eval_batches(corpus, 16, 2, 10, dp_rank=r, dp_size=2) for r in range(2)]
    assert torch.equal(torch.cat([halves[0][1], halves[1][1]]), batches[1])


def test_bad_sources_are_one_line_config_errors(tmp_path):
    good = write_docs(tmp_path / "a.jsonl", "a")
    cfg = config.compose([f"data.sources=[{{source:'{good}',weight:0.3}},{{source:'{good}',weight:0.7}}]",
                          "data.tokenizer=bytes"])
    config.validate(cfg)
    assert [s.weight for s in cfg.data.sources] == [0.3, 0.7]
    for sources, tokenizer, key in (
            ([(str(good), 0.0), (str(good), 1.0)], "bytes", "data.sources[0].weight"),
            ([(str(good), 1.0), (str(tmp_path / "missing.jsonl"), 1.0)], "bytes", "data.sources[1].source"),
            ([(str(good), 1.0), (str(good), 1.0)], "bpe", "data.tokenizer"),
            ([(str(good), 1.0), (str(good), 1e-8)], "bytes", "data.sources")):
        bad = data.DataConfig(tokenizer=tokenizer, sources=[data.BlendSource(s, w) for s, w in sources])
        with pytest.raises(ConfigError) as err:
            blend.check_config(bad, data.check_config)
        assert err.value.key == key and "\n" not in str(err.value) and "Fix: " in str(err.value)


BLEND_RUN = SMALL + ["precision=fp32", "data.tokenizer=bytes", "train.max_steps=4", "checkpoint.interval=2",
                     "checkpoint.keep=0"]


def test_a_two_rank_blended_run_resumes_exactly(tmp_path, cache_dir):
    """Two ranks (dp=2) on a 0.3/0.7 blend: resuming from step 2 gives the uninterrupted run's
    losses bit for bit, and one rank (dp=1) resuming it continues the same run."""
    a, b = write_docs(tmp_path / "a.jsonl", "a", 200), write_docs(tmp_path / "b.jsonl", "b", 200)
    args = BLEND_RUN + [f"data.sources=[{{source:'{a}',weight:0.3}},{{source:'{b}',weight:0.7}}]"]
    blended = config.compose([arg for arg in args if arg.startswith("data.")]).data
    for source in blend.source_configs(dataclasses.replace(blended, cache_dir=str(cache_dir))):
        build.build(source)  # as `python -m corpus build` would, before a job of several ranks
    run_train(tmp_path / "straight", args, cache_dir, nproc=2)
    losses = [r["loss"] for r in read_metrics(tmp_path / "straight")]
    step2 = checkpoint.step_dir(tmp_path / "straight" / "checkpoints", 2)
    run_train(tmp_path / "resumed", args + [f"resume={step2}"], cache_dir, nproc=2)
    assert [r["loss"] for r in read_metrics(tmp_path / "resumed")] == losses[2:]
    run_train(tmp_path / "one", args + [f"resume={step2}"], cache_dir, nproc=1)
    assert [r["loss"] for r in read_metrics(tmp_path / "one")] == pytest.approx(losses[2:], rel=1e-5)


def test_the_build_command_builds_every_source_of_a_blend(tmp_path):
    """python -m corpus build with data.sources builds each source, as a job of several ranks
    (which never builds) will open them, then check verifies each."""
    import subprocess
    import sys
    from conftest import ROOT
    files = [write_docs(tmp_path / "a.jsonl", "a", 10), write_docs(tmp_path / "b.jsonl", "b", 10)]
    blend_args = ["data.tokenizer=bytes", f"data.cache_dir={tmp_path / 'cache'}",
                  f"data.sources=[{{source: '{files[0]}', weight: 1}}, {{source: '{files[1]}', weight: 3}}]"]
    for action in ("build", "check"):
        proc = subprocess.run([sys.executable, "-m", "corpus", action, "--workers", "1", "--quiet", *blend_args],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("tokens verified") == 2, proc.stdout
    for one in blend.source_configs(config.compose(blend_args).data):
        assert data.open_built(one).meta["tokens"] > 0
