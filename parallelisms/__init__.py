"""The parallelisms parallel.py applies to a model from outside it (torchtitan-style): tensor and
sequence parallelism (tensor_parallel.py), the pipeline schedules (pipeline.py), ZeRO data
parallelism and where a weight's gradient accumulates (zero.py), MegaScale's communication overlap
(overlap.py), what each parameter shard is (sharding.py) and where a rank's pieces sit in the
logical tensors a checkpoint stores (placement.py). parallel.py builds the sharded model from them;
checkpoint.py and optim.py read what a shard is; the rehearsal and the tests reach in too.
"""
