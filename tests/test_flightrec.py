"""PyTorch Flight Recorder dumps read into oplog.py's analysis (observe/flightrec.py): a real 3-rank gloo
job in which rank 1 posts an extra all-reduce, dumped by each rank as NCCL's watchdog names its
dumps, and a hand-made NCCL-form dump with sends and receives (gloo's recorder keeps none)."""
import json
import os
import pickle
import socket
import subprocess
import sys

import pytest

from observe import flightrec
from observe import diagnose, hangs

RANK_SCRIPT = r"""
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(4)
dist.all_reduce(t)                       # #1 of the world group, on every rank
dist.all_reduce(torch.ones(2, 3))        # #2
if rank == 1:
    work = dist.all_reduce(t, async_op=True)   # #3: rank 1's extra all-reduce, which no peer posts
import pickle, time
from torch._C._distributed_c10d import _dump_fr_trace
# gloo marks a collective completed in the recorder's group status just after wait() returns, so a
# dump taken at once can miss #2 (1 run in 15 under load). A watchdog dumps minutes later; here the
# rank dumps once its own two collectives read as completed.
deadline = time.monotonic() + 30
while True:
    dump = _dump_fr_trace(True, True, False)
    status = pickle.loads(dump)["pg_status"]
    if min(s["last_completed_collective"] for s in status.values()) >= 2 or time.monotonic() > deadline:
        break
    time.sleep(0.01)
with open(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank), "wb") as f:
    f.write(dump)
# No rank leaves before every rank has dumped: a peer's exit fails rank 1's extra all-reduce, which
# the recorder then counts as completed. Rank 0 holds the store, so it leaves last.
store = dist.distributed_c10d._get_default_store()
if store.add("dumped", 1) == 3:
    store.set("all dumped", "1")
store.wait(["all dumped"])
if rank == 0:
    store.wait(["left 1", "left 2"])
else:
    store.set(f"left {rank}", "1")
os._exit(0)  # rank 1's all-reduce never completes
"""


@pytest.fixture(scope="module")
def gloo_dumps(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fr")
    script = folder / "job.py"
    script.write_text(RANK_SCRIPT)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
               TORCH_FR_BUFFER_SIZE="64", TORCH_FR_DUMP_TEMP_FILE=str(folder / "dumps" / "nccl_trace_rank_"))
    (folder / "dumps").mkdir()
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=folder, env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(3)]
    outputs = [p.communicate(timeout=120)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    return folder / "dumps"


def test_a_gloo_dump_reads_as_an_op_log_with_its_sequence_numbers_sizes_and_call_sites(gloo_dumps):
    snaps = flightrec.read_dumps(gloo_dumps)
    assert sorted(snaps) == [0, 1, 2]
    ops = {r: [dict(zip(s["fields"], e)) for e in s["ops"]] for r, s in snaps.items()}
    assert [(o["op"], o["seq"], o["bytes"], o["dtype"]) for o in ops[0]] == [("all_reduce", 1, 16, "float"),
                                                                             ("all_reduce", 2, 24, "float")]
    assert [o["site"] for o in ops[1]] == ["job.py:6 <module>", "job.py:7 <module>", "job.py:9 <module>"]
    assert all(o["done"] is not None for o in ops[1][:2]) and ops[1][2]["done"] is None  # the extra one
    assert snaps[1]["members"][ops[1][0]["group"]] == [0, 1, 2]


def test_a_gloo_dump_names_the_extra_all_reduce_and_the_ranks_that_never_posted_it(gloo_dumps, capsys):
    diagnose.main([str(gloo_dumps)])  # python oplog.py DUMP_DIR
    stdout = capsys.readouterr().out
    diagnosis = json.loads((gloo_dumps / "observe" / "diagnosis.json").read_text())
    hang = diagnosis["hang"]
    assert diagnosis["source"] == "flight recorder" and diagnosis["ranks"] == [0, 1, 2]
    assert (hang["op"], hang["seq"], hang["site"]) == ("all_reduce", 3, "job.py:9 <module>")
    assert hang["posted"] == [1] and hang["missing"] == [0, 2] and hang["rank"] in (0, 2)
    assert "never by [0, 2]" in stdout
    events = json.loads((gloo_dumps / "observe" / "trace.json").read_text())["traceEvents"]
    assert {e["tid"] for e in events if e["ph"] == "X"} == {0, 1, 2}
    assert sorted(e["id"] for e in events if e["ph"] == "s") == sorted(e["id"] for e in events if e["ph"] == "f")


def _entry(seq, op, p2p_seq=0, state="completed", sizes=((4,),), t=1.0, frames=None, group=("7", "mesh_pp")):
    return {"process_group": group, "pg_id": 7, "collective_seq_id": seq, "p2p_seq_id": p2p_seq,
            "profiling_name": f"nccl:{op}", "input_sizes": [list(s) for s in sizes], "input_dtypes": ["BFloat16"],
            "state": state, "time_created_ns": int(t * 1e9), "time_discovered_started_ns": int((t + 0.1) * 1e9),
            "time_discovered_completed_ns": int((t + 0.2) * 1e9) if state == "completed" else None,
            "is_p2p": " " in op, "frames": frames or [{"name": "isend", "filename": "/x/torch/distributed/c.py",
                                                       "line": 1}, {"name": "run", "filename": "/job/pipe.py",
                                                                    "line": 42}]}


def test_a_send_whose_receive_was_never_posted_names_the_receiver_by_its_global_rank(tmp_path):
    """A pipeline group of global ranks 3 and 5: rank 3's second send to group rank 1 (global 5)
    waits; rank 5 posted one receive. The peer is mapped through the group's members."""
    config = {"7": {"name": "7", "desc": "mesh_pp", "ranks": "[3, 5]"}}
    dumps = {3: [_entry(0, "send 0->1", 1), _entry(0, "send 0->1", 2, state="started", t=2.0)],
             5: [_entry(0, "recv 1<-0", 1)]}
    for rank, entries in dumps.items():
        (tmp_path / f"trace_{rank}").write_bytes(pickle.dumps(
            {"version": "2.10", "pg_config": config, "pg_status": {}, "entries": entries}))
    snaps = flightrec.read_dumps(tmp_path)
    send = dict(zip(snaps[3]["fields"], snaps[3]["ops"][1]))
    assert (send["op"], send["peer"], send["pair_seq"], send["bytes"], send["site"]) == ("send", 5, 2, 8,
                                                                                         "pipe.py:42 run")
    root = hangs.localize(snaps)
    assert (root["rank"], root["reason"], root["op"], root["seq"], root["peer"]) == (5, "busy", "send", 2, 5)
