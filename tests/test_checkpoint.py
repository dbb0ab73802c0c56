"""Sharded checkpoints (checkpoint.py): resume at the same layout is bitwise, resume at another
layout continues the same training within fp32 tolerance, async saves write the same bytes as
sync ones, a checkpoint that does not verify is never loaded, and a load unpickles nothing of ours
(non-tensor state is JSON)."""
import json
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint

import checkpoint
from parallelisms import placement
import train
from conftest import SMALL, first_good_run, read_metrics, run_train

# Saved at tp2 x dp2 with ZeRO-1: TP slices and ZeRO's flat ranges of them are both in the files.
SAVED_AT = ["parallel.tp=2", "parallel.zero_stage=1"]
ARGS = SMALL + ["precision=fp32", "train.max_steps=5"]
PP2_VPP2 = ["parallel.pp=2", "parallel.vpp=2", "parallel.microbatches=4"]


@pytest.fixture(scope="module")
def straight(ci_stress):
    """5 uninterrupted steps at tp2 x dp2, saving at step 3: the run the CI stress pass's resume
    starts from (experiments/stress.py's saved_tp2_dp2, this very command)."""
    first_good_run(ci_stress("resume_pp2_vpp2"))
    run_dir = ci_stress.setups["saved_tp2_dp2"]
    return [r["loss"] for r in read_metrics(run_dir)], checkpoint.step_dir(run_dir / "checkpoints", 3)


def test_resume_at_the_same_layout_is_bitwise(straight, tmp_path, cache_dir):
    losses, step3 = straight
    run_train(tmp_path, ARGS + SAVED_AT + [f"resume={step3}"], cache_dir, nproc=4)
    assert [r["loss"] for r in read_metrics(tmp_path)] == losses[3:]


@pytest.mark.parametrize("ranks, layout", [
    (1, ["parallel.zero_stage=0"]),                                            # tp1 x pp1 x dp1
    (2, PP2_VPP2),                                                             # tp2 -> pp2 vpp2, dp2 -> 1
    (2, ["parallel.zero_stage=2"]),                                            # tp2 -> 1, dp2, zero 1 -> 2
])
def test_resume_at_another_layout_continues_the_same_run(straight, ranks, layout, tmp_path, cache_dir, ci_stress):
    """Model and optimizer state (Adam moments of ZeRO shards included) land where the new layout
    keeps them: the next steps' losses are the uninterrupted run's, within fp32 tolerance."""
    losses, step3 = straight
    if layout == PP2_VPP2:  # the CI stress pass's case: its first run
        tmp_path = first_good_run(ci_stress("resume_pp2_vpp2"))
    else:
        run_train(tmp_path, ARGS + layout + [f"resume={step3}"], cache_dir, nproc=ranks)
    resumed = [r["loss"] for r in read_metrics(tmp_path)]
    assert len(resumed) == 2
    assert resumed == pytest.approx(losses[3:], rel=1e-5)


def test_zero3_resumes_a_hybrid_zero1_checkpoint_and_hybrid_zero1_a_zero3_one_bitwise(tmp_path, cache_dir):
    """dp4 at ZeRO-1 with hybrid sharding (dp_shard=2: each half of a bucket held by two replicas,
    which both write it, and DCP keeps one) and at ZeRO-3 over all four compute the same sums: each
    saves at step 3, the other resumes it, and the last two losses are the uninterrupted run's, bit
    for bit (ZeRO-3 saves each rank's flat ranges, as mixed precision's masters are, and loads into
    its shards; the replicas of a hybrid shard each read the same ranges)."""
    layouts = {"zero1_shard2": ["parallel.zero_stage=1", "parallel.dp_shard=2"], "zero3": ["parallel.zero_stage=3"]}
    runs = {}
    for name, layout in layouts.items():
        runs[name] = tmp_path / name
        run_train(runs[name], ARGS + layout + ["checkpoint.interval=3"], cache_dir, nproc=4)
    losses = {name: [r["loss"] for r in read_metrics(run_dir)] for name, run_dir in runs.items()}
    assert losses["zero1_shard2"] == losses["zero3"]
    for saved, resumed in (("zero1_shard2", "zero3"), ("zero3", "zero1_shard2")):
        run_dir = tmp_path / f"{saved}_to_{resumed}"
        step3 = checkpoint.step_dir(runs[saved] / "checkpoints", 3)
        run_train(run_dir, ARGS + layouts[resumed] + [f"resume={step3}"], cache_dir, nproc=4)
        assert [r["loss"] for r in read_metrics(run_dir)] == losses[saved][3:], (saved, resumed)


def test_uneven_pipeline_chunks_resume_an_even_pp2_checkpoint(tmp_path, cache_dir):
    """Blocks keep their global names whatever the chunks: a pp2 checkpoint of two stages of 2
    blocks resumes at pp2 vpp2 in chunks of 0, 2, 2 and 0 blocks (parallel.pp_first/last_chunk_layers:
    blocks 0 and 1 move to the other rank, the embedding and the head to chunks of their own), and
    the last two losses are the uninterrupted run's."""
    saved = tmp_path / "even"
    run_train(saved, ARGS + ["parallel.pp=2", "parallel.microbatches=4", "checkpoint.interval=3"], cache_dir, nproc=2)
    losses = [r["loss"] for r in read_metrics(saved)]
    resumed = tmp_path / "uneven"
    run_train(resumed, ARGS + PP2_VPP2 + ["parallel.pp_first_chunk_layers=0", "parallel.pp_last_chunk_layers=0",
                                          f"resume={checkpoint.step_dir(saved / 'checkpoints', 3)}"], cache_dir, nproc=2)
    assert [r["loss"] for r in read_metrics(resumed)] == pytest.approx(losses[3:], rel=1e-5)


@pytest.mark.parametrize("n_kv_heads", [2, 1])
def test_llama_resumes_at_tp2_from_a_one_process_checkpoint(n_kv_heads, tmp_path, cache_dir):
    """The Llama block's TP slices read from a layout-free checkpoint: each rank's rows of the
    grouped QKV (one KV group; with one KV head, the same whole QKV on both ranks) and of the
    interleaved gate/up fc_in (its units' pairs), Adam's moments with them. The resumed steps are
    the uninterrupted run's."""
    args = [o.replace("model=tiny", "model=llama_tiny") for o in ARGS] + ["checkpoint.interval=3",
                                                                         f"model.n_kv_heads={n_kv_heads}"]
    run_train(tmp_path / "straight", args, cache_dir)
    losses = [r["loss"] for r in read_metrics(tmp_path / "straight")]
    step3 = checkpoint.step_dir(tmp_path / "straight" / "checkpoints", 3)
    run_train(tmp_path / "tp2", args + SAVED_AT + [f"resume={step3}"], cache_dir, nproc=2)
    resumed = [r["loss"] for r in read_metrics(tmp_path / "tp2")]
    assert len(resumed) == 2 and resumed == pytest.approx(losses[3:], rel=1e-5)


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory, cache_dir):
    """4 steps in one process, saving (synchronously) at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("sync")
    run_train(run_dir, ASYNC_ARGS, cache_dir)
    return run_dir


ASYNC_ARGS = SMALL + ["precision=fp32", "train.max_steps=4", "checkpoint.interval=2", "checkpoint.keep=0"]


def test_async_save_writes_what_sync_save_writes(sync_run, tmp_path, cache_dir):
    run_train(tmp_path, ASYNC_ARGS + ["checkpoint.async_save=true"], cache_dir)
    for step in (2, 4):
        sync, asyn = (checkpoint.step_dir(d / "checkpoints", step) for d in (sync_run, tmp_path))
        a, b = saved_items(sync), saved_items(asyn)
        assert a.keys() == b.keys() and any(k[0].startswith("optim/") for k in a if isinstance(k, tuple))
        for key in a:
            if key != "config":  # (which says checkpoint.async_save=true in one of them)
                assert same(a[key], b[key]), (step, key)
    stalls = json.loads((tmp_path / "run.json").read_text())["final"]["checkpoint_stall_s"]
    assert len(stalls) == 2


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.equal(a, b)
    if hasattr(a, "shape"):  # numpy
        return a.shape == b.shape and (a == b).all()
    return a == b


def saved_items(folder) -> dict:
    """Every item as stored, by key (and offset for tensor pieces): a tensor's raw bytes, and a
    non-tensor's value (stored as JSON)."""
    meta = torch.distributed.checkpoint.FileSystemReader(folder).read_metadata()
    out = {}
    for index, info in meta.storage_data.items():
        with open(folder / info.relative_path, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        if isinstance(meta.state_dict_metadata[index.fqn], torch.distributed.checkpoint.metadata.BytesStorageMetadata):
            out[index.fqn] = json.loads(raw)
        else:
            out[(index.fqn, tuple(index.offset))] = raw
    return out


def test_a_checkpoint_that_does_not_verify_is_skipped(sync_run, tmp_path, capsys):
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(sync_run / "checkpoints", ckpt)
    step2, step4 = checkpoint.step_dir(ckpt, 2), checkpoint.step_dir(ckpt, 4)
    assert checkpoint.latest(ckpt) == step4
    data = next(step4.glob("*.distcp"))
    original = data.read_bytes()
    data.write_bytes(original[:len(original) // 2])  # truncated
    assert "not the size" in checkpoint.problem(step4) and checkpoint.latest(ckpt) == step2
    data.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # same size, one bit flipped
    assert "sha256" in checkpoint.problem(step4) and checkpoint.latest(ckpt) == step2
    # train.py, told to resume from it, says why in one line and exits 2
    with pytest.raises(SystemExit) as exit:
        train.resume(str(step4), ckpt, None, None, None, None, None)
    err = capsys.readouterr().err.strip()
    assert exit.value.code == 2 and err.startswith("config error: resume:") and len(err.splitlines()) == 1
    data.write_bytes(original)
    (step4 / checkpoint.MANIFEST).unlink()  # an interrupted save: its manifest was never written
    assert checkpoint.latest(ckpt) == step2
    shutil.rmtree(step2)
    assert checkpoint.latest(ckpt) is None


@pytest.mark.parametrize("shape, lo, hi, expected", [
    ((10,), 3, 7, [((3,), (4,), 3)]),
    ((4, 5), 5, 15, [((1, 0), (2, 5), 5)]),                                       # whole rows
    ((4, 5), 7, 9, [((1, 2), (1, 2), 7)]),                                        # inside one row
    ((4, 5), 3, 17, [((0, 3), (1, 2), 3), ((1, 0), (2, 5), 5), ((3, 0), (1, 2), 15)]),
    ((4, 5), 3, 10, [((0, 3), (1, 2), 3), ((1, 0), (1, 5), 5)]),
    ((4, 5), 6, 6, []),
])
def test_a_flat_range_is_covered_by_rectangles(shape, lo, hi, expected):
    rects = placement.flat_range_rectangles(shape, lo, hi)
    assert rects == expected
    values = torch.arange(torch.Size(shape).numel()).view(shape)
    covered = sorted(int(v) for offs, sizes, _ in rects
                     for v in values[tuple(slice(o, o + n) for o, n in zip(offs, sizes))].flatten())
    assert covered == list(range(lo, hi))


# --- What a crash leaves, and checkpoints of other models ---

def test_a_crash_mid_save_loses_no_checkpoint(sync_run, tmp_path, cache_dir):
    """What a run killed while saving leaves: step 4's save half-written (step_4.partial: a data file
    cut short, the manifest's temporary file), and an earlier attempt's step 4 moved aside
    (step_4.old) when the rename that replaces it was cut. The next run recovers all of it: it puts
    step 4 back, resumes from it, writes nothing stray on stderr, and leaves no partial folder."""
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(sync_run / "checkpoints", ckpt)
    step4 = checkpoint.step_dir(ckpt, 4)
    partial = step4.with_name(step4.name + checkpoint.PARTIAL)
    shutil.copytree(step4, partial)
    (partial / checkpoint.MANIFEST).rename(partial / f"{checkpoint.MANIFEST}.tmp4242")
    data = next(partial.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:1000])
    step4.rename(step4.with_name(step4.name + checkpoint.REPLACED))
    shutil.copy(sync_run / "metrics.jsonl", tmp_path / "metrics.jsonl")
    proc = run_train(tmp_path, ASYNC_ARGS + ["train.max_steps=6", "resume=auto"], cache_dir)
    assert "resumed from" in proc.stdout + proc.stderr and f"{step4} (step 4)" in proc.stdout + proc.stderr
    stray = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("[")]
    assert stray == [], stray
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000002", "step_00000004", "step_00000006"]
    assert all(checkpoint.problem(p) is None for p in ckpt.iterdir())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # appended to, never rewritten


def test_publish_replaces_a_step_and_recover_undoes_a_cut_rename(tmp_path):
    """publish() renames a finished save into place; a crash between its two renames leaves the old
    copy as step_N.old and no step_N, and recover() puts it back (and drops unfinished saves)."""
    folder = checkpoint.step_dir(tmp_path, 7)
    for name, text in ((folder, "old"), (folder.with_name(folder.name + checkpoint.PARTIAL), "new")):
        name.mkdir()
        (name / "x").write_text(text)
    checkpoint.publish(folder.with_name(folder.name + checkpoint.PARTIAL), folder)
    assert (folder / "x").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == [folder.name]
    folder.rename(folder.with_name(folder.name + checkpoint.REPLACED))  # cut after the first rename
    (tmp_path / f"step_00000008{checkpoint.PARTIAL}").mkdir()
    checkpoint.recover(tmp_path)
    assert (folder / "x").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == [folder.name]


@pytest.mark.parametrize("other, says", [
    (["model.n_layers=3"], "n_layers 4 there, 3 here"),         # fewer layers: would load into the first 3
    (["model.d_model=128"], "d_model 256 there, 128 here"),     # other shapes
    (["model.mlp=swiglu"], "mlp gelu there, swiglu here"),     # other maths (and widths)
])
def test_resuming_another_models_checkpoint_is_one_line(sync_run, tmp_path, cache_dir, other, says):
    step4 = checkpoint.step_dir(sync_run / "checkpoints", 4)
    proc = run_train(tmp_path, ASYNC_ARGS + other + [f"resume={step4}"], cache_dir, check=False)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("config error: resume:") and says in err and "Fix:" in err
    assert not (tmp_path / "checkpoints").exists()  # nothing trained, nothing saved


def test_a_checkpoint_of_other_shapes_is_refused_by_load(sync_run):
    """The loader's own check, for a checkpoint whose config cannot say (written by other code):
    every model tensor's logical shape must be this model's, or one line naming the first that is not."""
    import optim
    import parallel
    from errors import ConfigError
    from model import GPT, ModelConfig
    with torch.device("meta"):
        model = GPT(ModelConfig(n_layers=4, n_heads=4, d_model=128, vocab_size=512))
    layout = parallel.build_layout(parallel.ParallelConfig(), 0, 1, torch.device("cpu"))
    engine = parallel.build(model, layout, parallel.ParallelConfig(), device=torch.device("cpu"))
    opt = optim.build_optimizer(engine.named_optimizer_parameters(), optim.OptimConfig(), 1e-3)
    with pytest.raises(ConfigError, match=r"holds model/\S+ as \[\d+(, \d+)*\], this model as .*another model"):
        checkpoint.load(checkpoint.step_dir(sync_run / "checkpoints", 4), engine, opt, None, None)


class RecordingLoader:
    def load_state_dict(self, state: dict) -> None:
        self.state = state


def test_loading_unpickles_nothing_but_dcps_metadata(sync_run, monkeypatch):
    """A load in this process reads the optimizer's settings, the scheduler, the data position and
    Python's and numpy's RNG states as JSON, and every tensor (torch's RNG state included) with
    torch.load(weights_only=True): the only pickle it opens is DCP's own .metadata. What it
    restores is what the run saved."""
    import optim
    import parallel
    from model import GPT
    folder = checkpoint.step_dir(sync_run / "checkpoints", 4)
    model = GPT(checkpoint.saved_model_config(folder))
    layout = parallel.build_layout(parallel.ParallelConfig(), 0, 1, torch.device("cpu"))
    engine = parallel.build(model, layout, parallel.ParallelConfig(), device=torch.device("cpu"))
    opt = optim.build_optimizer(engine.named_optimizer_parameters(), optim.OptimConfig(), 1e-3)
    scheduler, loader = optim.build_scheduler(opt, optim.OptimConfig(), 4), RecordingLoader()
    unpickled, loads, ours = [], [], checkpoint.rng_state()
    load, torch_load = pickle.load, torch.load
    monkeypatch.setattr(pickle, "load", lambda f, *a, **k: unpickled.append(f.name) or load(f, *a, **k))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled bytes"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(k.get("weights_only")) or torch_load(*a, **k))
    assert checkpoint.load(folder, engine, opt, scheduler, loader) == 4
    monkeypatch.undo()
    assert unpickled and all(name.endswith(".metadata") for name in unpickled), unpickled
    assert loads and all(w is True for w in loads), loads
    items = saved_items(folder)  # (every non-tensor item parses as JSON)
    assert loader.state == items["loader"] and loader.state["sampler"]["consumed"] == 4 * 8
    assert scheduler.state_dict()["last_epoch"] == items["scheduler"]["last_epoch"] == 4
    assert all(isinstance(g["betas"], tuple) for g in opt.param_groups)
    restored = checkpoint.rng_state()
    checkpoint.set_rng_state(ours)
    rng = {"rng/0/torch": torch.empty(checkpoint.saved_keys(folder)["rng/0/torch"].size, dtype=torch.uint8)}
    checkpoint._read_alone(folder, rng)
    assert torch.equal(restored["torch"], rng["rng/0/torch"])
    assert {k: restored[k] for k in ("python", "numpy")} == items["rng/0"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_in_the_pickled_format_is_refused_in_one_line(tmp_path, capsys):
    """A checkpoint of the format before this one (its non-tensor state pickled by DCP, no "format"
    item) is neither unpickled nor loaded: resume and export stop in one line naming the fix."""
    from errors import ConfigError
    folder = checkpoint.step_dir(tmp_path, 2)
    torch.distributed.checkpoint.save({"model/w": torch.zeros(2), "step": 2, "config": {"model": {}}},
                                      checkpoint_id=folder, no_dist=True)
    checkpoint.mark_complete(folder)
    assert checkpoint.problem(folder) is None
    with pytest.raises(ConfigError, match=r"CKPT: .*checkpoint format 1, whose .* pickled.* Fix: resume=none"):
        checkpoint.saved_model_config(folder)
    assert checkpoint.model_mismatch(folder, object()) is None  # (load says why)
    with pytest.raises(SystemExit) as exit:
        train.resume(str(folder), tmp_path, None, None, None, None, None)
    err = capsys.readouterr().err.strip()
    assert exit.value.code == 2 and err.startswith("config error: resume:") and len(err.splitlines()) == 1
    assert "format 1" in err and "Fix: resume=none" in err


def test_async_saves_reuse_one_staging_buffer(tmp_path):
    """Every asynchronous save stages into the same host buffer (allocated once, by the first), and
    each checkpoint still holds the values of its own step: the second snapshot does not leak into
    the first's files, nor the first's into the second."""
    weight, moment = torch.arange(12.0).view(3, 4), torch.ones(5)
    saver = checkpoint.Saver(tmp_path, keep=0, async_save=True)
    storages = []
    for step in (1, 2):
        state = {"model/w": placement.Chunks((6, 4), [((3, 0), weight)]), "optim/m": moment,
                 "step": checkpoint._blob(step)}
        saver.save(step, state)
        storages.append(saver.staging.buffer.untyped_storage().data_ptr())
        weight.mul_(10), moment.add_(1)  # training goes on while the snapshot is written
    saver.wait()
    assert storages[0] == storages[1]
    for step, scale in ((1, 1.0), (2, 10.0)):
        folder = checkpoint.step_dir(tmp_path, step)
        assert checkpoint.problem(folder) is None and checkpoint.read_blob(folder, "step") == step
        back = {"model/w": placement.Chunks((6, 4), [((3, 0), torch.zeros(3, 4))]), "optim/m": torch.zeros(5)}
        checkpoint._read_alone(folder, back)
        assert torch.equal(back["model/w"].pieces[0][1], torch.arange(12.0).view(3, 4) * scale)
        assert torch.equal(back["optim/m"], torch.full((5,), float(step)))


def test_checkpointing_costs_each_rank_no_connection_per_rank(tmp_path):
    """On 8 real gloo ranks: making the checkpoint group and the start's barrier connect nothing and
    read nothing from the store (gloo's default, a full mesh, costs W-1 of each per rank); a save and a resume check
    connect each rank but DCP's coordinator to fewer than W-1 peers, and the check costs a rank a
    stat and an open or two for each file it checks, one file in W, not two calls per file of the
    checkpoint; no rank but the one writing the manifest lists the step folder."""
    from ckpt_costs_probe import checkpoint_costs
    from conftest import spawn
    world = 8
    spawn(checkpoint_costs, world, str(tmp_path))
    costs = [json.loads((tmp_path / f"costs{r}.json").read_text()) for r in range(world)]
    # (gloo's one listening socket per group, which a lazy group opens too)
    assert all(c["start"]["sockets"] <= 1 and c["start"]["store_reads"] == 0 for c in costs), [c["start"] for c in costs]
    assert all(c["verify"]["why"] is None for c in costs)
    files = world + 1  # a .distcp per rank and DCP's .metadata
    for rank, c in enumerate(costs):
        mine = len(range(rank, files, world))
        assert c["verify"]["fs"]["stat"] <= 2 + mine and c["verify"]["fs"].get("listed", 0) == 0, (rank, c)
        assert c["verify"]["fs"]["open"] <= 1 + mine, (rank, c)
        if rank > 0:
            assert c["save"]["fs"].get("listed", 0) == 0, (rank, c)
            assert c["verify"]["sockets"] < world - 1 and c["verify"]["store_reads"] < world - 1, (rank, c)
