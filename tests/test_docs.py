"""The README and docs/ as a user meets them: every fenced shell command runs in a cheap, faithful
form, and nothing a user reads refers to the project's tracker or to how the work was organised.

Each command is checked by what it starts, in this process where that is cheap:
- train.py under python, torchrun, srun, sbatch, submit.py or emucluster: every job of the command
  line composed and validated as train.py would (config.preflight, with the launcher's world), a
  dry run where the command asks for one, and for a GPU launch (srun, sbatch, submit.py, the
  submitit launcher) the layout's world equal to the allocation and the fullest rank's memory
  within the GPU's (clustermodel.memory.memory: the rehearsal where one is remembered, else the model);
- `python -m clustermodel` run for real (its studies take seconds); `validate`, which measures this machine
  first, has its arguments parsed;
- experiments/*.py and export_hf.py: their argparse parsers take the command's arguments (nothing
  runs beyond parsing);
- make targets with `make -n`, shell scripts with `bash -n`, pytest's paths exist;
- sudo only with the venv's interpreter or an executable script with a shebang; no bare python or
  torchrun (the venv is not activated for the reader).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import io
import re
import shlex
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PY = ".venv/bin/python"
TORCHRUN = ".venv/bin/torchrun"
GPU_TENSOR_GIB = 80.0 - 6.5  # what an A100/H100 80GB's tensors may use (conf/hardware/a100_cluster.yaml), where the command names no hardware with its memory


# --- Extracting the commands ---

def fenced_commands(path: Path) -> list:
    """[(line number, command)] of every ```bash/```sh block, continuation lines joined, comments and
    blank lines dropped."""
    out, block, start, lines = [], None, 0, path.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        fence = re.match(r"^\s*```\s*(\w*)", line)
        if fence and block is None:
            block = fence.group(1) in ("bash", "sh", "shell", "console")
            continue
        if fence:
            block = None
            continue
        if not block:
            continue
        if out and out[-1][1].endswith("\\"):
            out[-1] = (out[-1][0], out[-1][1][:-1] + " " + line.strip())
        elif line.strip() and not line.strip().startswith("#"):
            out.append((n, line.strip()))
    return [(n, " ".join(shlex.split(cmd, comments=True))) for n, cmd in out]


COMMANDS = [(f"{p.relative_to(ROOT)}:{n}", cmd) for p in DOCS for n, cmd in fenced_commands(p)]


def test_the_docs_have_commands_and_every_fence_is_closed():
    assert len(COMMANDS) >= 40, f"{len(COMMANDS)} commands found in README.md and docs/"
    for path in DOCS:
        assert path.read_text().count("```") % 2 == 0, f"{path.name}: an unclosed code fence"


# --- Checking one command ---

class Parsed(Exception):
    """Raised in place of running a script once its arguments parsed."""


@contextlib.contextmanager
def parse_only():
    """argparse parses as usual (an unknown option or a bad value exits 2) and then stops the script."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed()
    argparse.ArgumentParser.parse_args = parse_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original


def run_script_parser(script: str, args: list) -> None:
    """Import the script as its own module and call main() with the command's arguments, parse only."""
    import importlib.util
    path = ROOT / script
    assert path.is_file(), f"{script} does not exist"
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(f"docs_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
        main = getattr(module, "main", None)
        assert main is not None, f"{script} has no main() whose arguments could be checked"
        saved = sys.argv
        sys.argv = [script, *args]
        try:
            with parse_only(), contextlib.redirect_stdout(io.StringIO()):
                try:
                    main(args) if main.__code__.co_argcount else main()
                except Parsed:
                    return
                except SystemExit as exit_:
                    assert exit_.code in (0, None), f"{script} {' '.join(args)}: exit {exit_.code}"
                    return
        finally:
            sys.argv = saved
        pytest.fail(f"{script} ran past its argument parsing without argparse")
    finally:
        sys.path.remove(str(path.parent))


def options(argv: list) -> dict:
    """--key value / --key=value options of a launcher's command line, up to the program it starts."""
    out, k = {}, 0
    while k < len(argv) and argv[k].startswith("-"):
        key, _, value = argv[k].partition("=")
        if not value and k + 1 < len(argv) and not argv[k + 1].startswith("-"):
            k += 1
            value = argv[k]
        out[key] = value
        k += 1
    return out


def split_at_program(argv: list, program: str) -> tuple:
    assert program in argv, f"no {program} in {' '.join(argv)}"
    k = argv.index(program)
    return argv[:k], argv[k + 1:]


@contextlib.contextmanager
def launched_as(world: int | None, var: str):
    """The environment a launcher gives train.py: WORLD_SIZE (torchrun) or SLURM_NTASKS (srun)."""
    import os
    saved = {v: os.environ.pop(v, None) for v in ("WORLD_SIZE", "SLURM_NTASKS")}
    if world is not None:
        os.environ[var] = str(world)
    try:
        yield
    finally:
        for v, value in saved.items():
            os.environ.pop(v, None)
            if value is not None:
                os.environ[v] = value


def check_train(args: list, world: int | None = None, gpus: bool = False, var: str = "WORLD_SIZE",
                remote: bool = False) -> None:
    """train.py's command line: composed and validated for every job, dry-run where asked, and on a
    GPU launch the world and the memory of the fullest rank checked against the allocation."""
    import config
    import machine
    from clustermodel import dry_run, memory, perfmodel
    printing = "--cfg" in args or "--help" in args  # train.py prints and exits: the config must still compose
    overrides = [a for a in args if a not in ("--cfg", "job", "hydra", "all", "--help")]
    if printing:
        for job in config.job_overrides(overrides):
            config.compose(job)
        return
    with contextlib.redirect_stdout(io.StringIO()), launched_as(None if remote else world, var):
        jobs = config.preflight(overrides, remote_world=world if remote else None)
    assert jobs, f"train.py {' '.join(args)}: no job"
    for job_overrides, cfg, job_world in jobs:
        if cfg.dry_run:
            with contextlib.redirect_stdout(io.StringIO()):
                dry_run.report(cfg)
        launched = job_world if job_world is not None else world
        if not (gpus or cfg.study.scale == "cluster") or launched is None:
            continue
        p = cfg.parallel
        if p.dp > 0:
            assert p.tp * p.pp * p.dp == launched, (f"train.py {' '.join(job_overrides)}: tp*pp*dp = "
                                                    f"{p.tp * p.pp * p.dp} ranks, but the launch starts {launched}")
        capacity = machine.tensor_memory_gib(cfg.hardware) or GPU_TENSOR_GIB
        mem = memory.memory(cfg, perfmodel.layout_of(cfg, launched), capacity)
        assert mem.fits, (f"train.py {' '.join(job_overrides)}: {mem.total:.1f} GiB per GPU "
                          f"({mem.source}) does not fit in {capacity:.1f} GiB")


def check_perfmodel(args: list) -> None:
    from clustermodel import cli
    if args and args[0] == "validate":  # it measures this machine for a minute first: arguments only
        _, _, dirs, flags = cli.parse(args)
        known = {"--remeasure", "--analytical-only"}
        assert all(f in known or f.startswith("--figure=") for f in flags), f"validate: unknown flag in {flags}"
        return
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        rc = cli.main(args)
    assert rc == 0, f"python -m clustermodel {' '.join(args)}: exit {rc}: {err.getvalue().strip()}"


def check_corpus(args: list) -> None:
    """python -m corpus build|check: its options parsed and its overrides composed (nothing built)."""
    import config
    assert args and args[0] in ("build", "check"), f"python -m corpus {' '.join(args)}: build or check"
    flags = {"--workers": 1, "--shard": 1, "--merge": 0, "--quiet": 0}
    overrides, rest = [], iter(args[1:])
    for a in rest:
        name = a.split("=")[0]
        if name in flags:
            if flags[name] and "=" not in a:
                next(rest)
        else:
            assert not a.startswith("-"), f"python -m corpus: unknown option {a}"
            overrides.append(a)
    config.compose(overrides)


def check_python(argv: list, world: int | None = None, gpus: bool = False, var: str = "WORLD_SIZE",
                 remote: bool = False) -> None:
    script, args = argv[0], argv[1:]
    if script == "train.py":
        check_train(args, world, gpus, var, remote)
    elif script == "-m" and args[0] == "clustermodel":
        check_perfmodel(args[1:])
    elif script == "-m" and args[0] == "corpus":
        check_corpus(args[1:])
    elif script == "-m" and args[0] == "observe":
        from observe import diagnose
        with parse_only(), contextlib.redirect_stdout(io.StringIO()):
            try:
                diagnose.main(args[1:])
            except Parsed:
                pass
    elif script == "-m" and args[0] == "pytest":
        paths = [a.split("::")[0] for a in args[1:] if a.startswith("tests/")]
        assert paths and all((ROOT / p).exists() for p in paths), f"pytest: no such test file in {args}"
    elif script == "experiments/slurm/submit.py":
        sbatch, overrides = split_at_program(args, "--")
        opts = options(sbatch)
        assert "--gpus-per-node" in opts, "submit.py without --gpus-per-node: one rank per node"
        check_train(overrides, int(opts.get("--nodes", 1)) * int(opts["--gpus-per-node"]), gpus=True, remote=True)
    elif script == "experiments/emucluster.py":
        own, rest = split_at_program(args, "--") if "--" in args else (args, [])
        run_script_parser(script, own + ["--", *rest])
        opts = options(own)
        if rest and rest[0] == "train.py":
            check_train(rest[1:], int(opts.get("--hosts", 1)) * int(opts.get("--ranks-per-host", 1)))
    elif script.endswith(".py"):
        run_script_parser(script, args)
    else:
        pytest.fail(f"python {script}: no cheap form known for this command")


def check_command(cmd: str) -> None:
    argv = shlex.split(cmd)
    env = {}
    while argv and re.match(r"^[A-Z_]+=", argv[0]):
        key, _, value = argv.pop(0).partition("=")
        env[key] = value
    program, rest = argv[0], argv[1:]
    if program == "sudo":
        assert rest[0] == PY or (ROOT / rest[0]).is_file() and (ROOT / rest[0]).read_text().startswith("#!"), (
            f"sudo {rest[0]}: name the venv's interpreter ({PY}), or an executable script")
        program, rest = rest[0], rest[1:]
    if program == PY:
        check_python(rest)
    elif program == "make":
        for target in rest:
            assert re.match(r"^[\w-]+$|^[A-Z_]+=", target), f"make {target}"
        out = subprocess.run(["make", "-n", *rest], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, f"make -n {' '.join(rest)}: {out.stderr.strip()}"
    elif program == "bash":
        assert (ROOT / rest[0]).is_file(), f"bash {rest[0]}: no such script"
        assert subprocess.run(["bash", "-n", rest[0]], cwd=ROOT).returncode == 0
    elif program == TORCHRUN:
        launcher, train_args = split_at_program(rest, "train.py")
        opts = options(launcher)
        check_train(train_args, int(opts["--nproc_per_node"]) * int(opts.get("--nnodes", 1)))
    elif program == "srun":
        launcher, tail = split_at_program(rest, PY)
        opts = options(launcher)
        for needed in ("--nodes", "--ntasks-per-node", "--gpus-per-node"):
            assert needed in opts, f"srun without {needed}"
        check_python(tail, int(opts["--nodes"]) * int(opts["--ntasks-per-node"]), gpus=True, var="SLURM_NTASKS",
                     remote=True)  # the ranks run on GPU nodes, not here
    elif program == "sbatch" and "experiments/slurm/build_corpus.sbatch" in rest:
        launcher, build_args = split_at_program(rest, "experiments/slurm/build_corpus.sbatch")
        assert "--array" in options(launcher) or any(a.startswith("--array=") for a in launcher), "a build without --array is one part"
        assert subprocess.run(["bash", "-n", "experiments/slurm/build_corpus.sbatch"], cwd=ROOT).returncode == 0
        check_corpus(["build", *build_args])
    elif program == "sbatch":
        launcher, train_args = split_at_program(rest, "experiments/slurm/train.sbatch")
        opts = options(launcher)
        assert "--gpus-per-node" in opts or "NPROC" in env, (
            "sbatch train.sbatch without --gpus-per-node (or NPROC=): it starts one rank per node")
        per_node = int(env.get("NPROC") or opts["--gpus-per-node"])
        gpus = "--gpus-per-node" in opts
        check_train(train_args, int(opts.get("--nodes", 1)) * per_node, gpus=gpus, remote=gpus)
    elif program.startswith("experiments/") and (ROOT / program).is_file():
        path = ROOT / program
        assert path.stat().st_mode & 0o111 and path.read_text().startswith("#!"), f"{program} is not executable"
        check_python([program, *rest])
    else:
        pytest.fail(f"{program}: use {PY} or {TORCHRUN} (the venv is not activated), or a command the test knows")


@pytest.mark.parametrize("where,cmd", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_documented_command_runs(where, cmd):
    check_command(cmd)


@pytest.mark.parametrize("cmd,why", [
    ("srun --nodes 4 --ntasks-per-node 8 --gpus-per-node 8 .venv/bin/python train.py model=13B train.batch_size=32",
     "does not fit in 73.5 GiB"),
    ("srun --nodes 4 --ntasks-per-node 8 --gpus-per-node 8 .venv/bin/python train.py model=13B", "train.batch_size"),
    ("sbatch --nodes 4 experiments/slurm/train.sbatch model=13B", "one rank per node"),
    ("sudo python experiments/calibrate_comm.py --sharing", "the venv's interpreter"),
    ("python train.py", "the venv is not activated"),
    (".venv/bin/python train.py model.n_layer=2 --cfg job", "model.n_layer"),
    (".venv/bin/python experiments/bench_step.py --nanogpt /tmp/n --no-such-flag", "unrecognized arguments"),
])
def test_a_broken_command_fails_the_check(cmd, why, capsys):
    """The checks catch what a documented command can get wrong: a layout that cannot fit or does not
    divide the batch, a launch without its GPUs, sudo or bare python outside the venv, a renamed key,
    an unknown flag; each with the reason a user would see."""
    with pytest.raises((Exception, SystemExit, pytest.fail.Exception)) as caught:
        check_command(cmd)
    captured = capsys.readouterr()
    assert why in f"{caught.value}\n{captured.out}\n{captured.err}"


def test_relative_links_in_the_docs_resolve():
    for path in DOCS + sorted((ROOT / "experiments" / "results").rglob("*.md")):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" not in target:
                assert (path.parent / target).exists(), f"{path.relative_to(ROOT)}: broken link {target}"


# --- Nothing a user reads refers to the tracker or to how the work was organised ---

FORBIDDEN = [
    (re.compile(r"\bissues?[ #-]*\d+", re.I), "an issue number"),
    (re.compile(r"\b(the )?issue's\b|\bthe issues? (asks?|allows?|define|aims?)", re.I), "the issue tracker"),
    (re.compile(r"shared/notes", re.I), "notes outside the repository"),
    (re.compile(r"\b(this|that|earlier|previous|last|next|another|three|two|several) sessions?\b|\bsessions? before\b",
                re.I), "a work session"),
    (re.compile(r"\bthe brief\b", re.I), "a brief"),
]
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")


def prose_of_python(path: Path) -> str:
    """Comments and docstrings of a Python file."""
    text = path.read_text()
    parts = [tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline) if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            parts.append(doc or "")
    return "\n".join(parts)


def user_texts():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    files = {ROOT / f for f in tracked} | set(DOCS) | set((ROOT / "experiments").rglob("*.md")) | set(ROOT.glob("*.py"))
    for path in sorted(files):
        rel = path.relative_to(ROOT).as_posix()
        if not path.is_file() or rel.startswith((".venv", "outputs", "multirun")):
            continue
        if path.suffix == ".py":
            yield rel, prose_of_python(path)
        elif path.suffix in (".md", ".yaml", ".csv", ".sbatch", ".sh", ".cff") or path.name in ("Makefile", "LICENSE"):
            yield rel, path.read_text()


def test_nothing_a_user_reads_refers_to_the_tracker_or_the_work_history():
    found = []
    for rel, text in user_texts():
        for pattern, what in FORBIDDEN:
            found += [f"{rel}: {what}: {m.group(0)!r}" for m in pattern.finditer(text)]
        headings = "\n".join(line for line in text.splitlines() if line.startswith("#")
                             and not (rel.startswith("experiments/") and re.match(r"^#+ 20\d\d-\d\d-\d\d", line))
                             ) if rel.endswith(".md") else ""
        found += [f"{rel}: a heading named after a commit: {m.group(0)!r}" for m in HASH.finditer(headings)]
        if rel.startswith("docs/") or rel.endswith(".py"):
            found += [f"{rel}: a commit hash (history belongs in experiments/results/): {m.group(0)!r}"
                      for m in HASH.finditer(text)]
    assert not found, "\n".join(found)


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 260
