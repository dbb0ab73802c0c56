"""The parallelisms parallel.py applies to a model from outside it (torchtitan-style): tensor and
sequence parallelism (tensor_parallel.py), the pipeline schedules (pipeline.py), ZeRO data
parallelism (zero.py), MegaScale's communication overlap (overlap.py) and what each parameter
shard is (sharding.py). Only parallel.py, the tests and the rehearsal reach into this package.
"""
