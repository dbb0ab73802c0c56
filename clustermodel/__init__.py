"""The model of a cluster job, beside the training code it models.

- perfmodel.py: step time, MFU and memory per GPU of a config on a cluster you don't have
  (rates.py: the machine's rates and the primitive costs it prices with; memory.py: the memory
  per GPU); cli.py: its studies,
  tables and command line (`python -m clustermodel ...`).
- dry_run.py: `train.py dry_run=true`: size, FLOPs and memory per GPU of a config, with no hardware.
- rehearsal.py: chosen ranks of a job of any size run through the real training code on one CPU,
  every collective, send, allocation and host read recorded (recorder.py), NCCL's rules checked
  (nccl_rules.py), memory and FLOPs counted (ledgers.py), per-rank start-up and host costs counted
  (rank_costs.py, host_syncs.py).
- replay.py: a rehearsal's program priced on a machine's rates; predicted.py: that replay laid
  beside a run's measured timeline (`python -m clustermodel.predicted RUN_DIR`).
- schema.py: this folder's part of the configuration (hardware.perfmodel, rehearse), a leaf that
  config.py assembles into the root.

The training path (the repository's flat files) imports from here only its schema, and lazily to
rehearse itself and to check a config's memory before any rank works.
"""
