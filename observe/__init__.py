"""Observability (MegaScale section 5): what every rank posted and where its time went, and on a hang,
a desync or a straggler, the rank it started from.

- oplog.py: the op log, spans and snapshots each rank keeps while it runs (Recorder, start, stop).
- comms.py: the one interposer on torch.distributed's collectives and sends, whose handlers (the op
  log's, the rehearsal's recorder's) record, hold back or stand in for each call.
- heartbeat.py: each rank's progress, published and watched; a stopped rank found and the job ended.
- hangs.py: where a hang started, from every rank's snapshot. lastwords.py: a rank's stacks and
  last snapshot on a signal. stragglers.py: the rank slower than its peers, and why.
- timeline.py: the cross-rank timeline (Perfetto trace, figures). flightrec.py: the same from
  PyTorch Flight Recorder dumps. spans.py: the timed segments, with no import of the rest.
- diagnose.py: the post-mortem, `python -m observe RUN_DIR`.
"""
