"""python -m corpus build|check [overrides] [--workers N] [--shard i/n] [--merge]

build: tokenize the corpus the data.* keys name (composed with Hydra as train.py composes them,
       so a job's own overrides, experiment=... included, name the corpus it trains on)
       into its folder under the data cache. --shard i/n builds the i-th of n parts (a SLURM array
       job's SLURM_ARRAY_TASK_ID of n); --merge then writes the one manifest from the parts.
check: read every shard of a built corpus: checksums, vocabulary, token ids. One line, exit 0 or 2.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project's flat modules, from any cwd

from errors import ConfigError, fail  # noqa: E402


def _shard(value: str) -> tuple:
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not i/n, e.g. 0/4") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"{value!r}: i must be in [0, n)")
    return i, n


def build_for(train_args: list, cache=None) -> None:
    """Build, in this process and once, the corpus a train.py command line trains on (its data.*
    overrides; cache: its $MEGAREPRO_CACHE): what a launcher of a job of several ranks, which
    never builds, does first."""
    import config
    from corpus import build
    cfg = config.compose([a for a in train_args if a.startswith("data.")]).data
    if cache is not None:
        cfg.cache_dir = str(cache)
    build.build(cfg, workers=1)


def main(argv: list) -> int:
    parser = argparse.ArgumentParser(prog="python -m corpus", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("build", "check"))
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="tokenizing processes (default: this machine's cores)")
    parser.add_argument("--shard", type=_shard, default=None, help="build part i of n (i from 0)")
    parser.add_argument("--merge", action="store_true", help="write the manifest from the parts --shard built")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args, overrides = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import config
    import data
    from corpus import build
    try:
        cfg = config.compose(overrides).data
    except Exception as err:
        fail(config.describe_composition_error(err))
    try:
        data.check_config(cfg)
        if args.action == "check":
            corpus = data.open_built(cfg)
            corpus.verify()
            print(f"corpus: {corpus.path}: {len(corpus.shards)} shards, {corpus.meta['tokens']:,} tokens verified")
        elif args.merge:
            build.merge(cfg)
        else:
            if args.workers < 1:
                raise ConfigError("--workers", f"{args.workers} < 1", "use at least one process")
            build.build(cfg, args.workers, args.shard, progress=not args.quiet and sys.stderr.isatty())
    except ConfigError as err:
        fail(str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
