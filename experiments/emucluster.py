#!/usr/bin/env -S sh -c 'p="$(dirname "$0")/../.venv/bin/python"; [ -x "$p" ] || p=python3; exec "$p" "$0" "$@"'
"""An emulated multi-host cluster on one machine: one network namespace per host, bandwidth-limited links.

    sudo experiments/emucluster.py --hosts 2 --ranks-per-host 1 --bandwidth 2gbit -- SCRIPT [ARGS...]

The first line runs it under the repository's .venv interpreter (python3 where there is none), so
it can be started directly, under sudo too.

On a small CPU machine, gloo over loopback is bound by CPU time (copies, reductions), so the
communication/compute overlap that MegaScale is about cannot show. A GPU cluster is different:
the NICs move the bytes while the GPUs compute. This emulates that: every "host" is a network
namespace with one veth link to a switch (a bridge in a namespace of its own), each link is
throttled with a token bucket (tbf; netem is not in every kernel, so there is no added latency),
and one torchrun per host joins a multi-node job across those links, as on a real cluster.
Ranks within a host talk over that namespace's loopback, as over NVLink inside a GPU host.

Everything lives in namespaces created here (named emc<pid>-*, addresses 10.77.0.0/24 only
inside them), so parallel runs do not collide and deleting the namespaces removes every link.
They are always deleted: on success, failure, Ctrl-C or SIGTERM, and namespaces left by an
emucluster that was SIGKILLed are swept by the next run.

Without root or without iproute2 it says so in one line and runs one torchrun on loopback.
The exit code is the worst of the hosts' (a host killed by a signal counts as 128 + signal).
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

PREFIX = "emc"
SUBNET = "10.77.0"
HOST_IFACE = "eth0"         # the host's link inside its namespace: GLOO_SOCKET_IFNAME
BURST = "256kb"             # token bucket depth; 256kb was enough for 2gbit at this kernel's timer rate
MASTER_PORT = 29500         # free by construction: the namespaces are new
RATE_RE = re.compile(r"^\d+(\.\d+)?[kmgt]?(bit|bps)$", re.IGNORECASE)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        usage="emucluster.py --hosts N [--ranks-per-host R] [--bandwidth RATE] [--host-bandwidth K=RATE] "
              "[--kill-host K --after S] [--timeout S] [--rundir DIR] -- SCRIPT [ARGS...]",
        description="Run a torchrun job across N emulated hosts (network namespaces) with throttled links.")
    p.add_argument("--hosts", type=int, default=1, help="number of emulated hosts (nodes)")
    p.add_argument("--ranks-per-host", type=int, default=1, help="torchrun --nproc_per_node on each host")
    p.add_argument("--bandwidth", default="2gbit",
                   help="each host's link rate, tc syntax (2gbit, 200mbit, 100mbps) or 'none' (default 2gbit)")
    p.add_argument("--host-bandwidth", action="append", default=[], metavar="K=RATE",
                   help="override host K's link rate, e.g. 1=200mbit for a straggler (repeatable)")
    p.add_argument("--kill-host", type=int, default=None, metavar="K",
                   help="SIGKILL every process of host K after --after seconds: a host that disappears")
    p.add_argument("--after", type=float, default=None, metavar="S", help="seconds before --kill-host")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="kill the whole job after S seconds (exit 124)")
    p.add_argument("--grace", type=float, default=30.0, metavar="S",
                   help="after a host fails, seconds the others get to exit before they are killed (default 30)")
    p.add_argument("--rundir", type=Path, default=None,
                   help="write each host's output to DIR/host<K>.log (it is streamed to stdout either way)")
    p.add_argument("--loopback", action="store_true", help="skip the namespaces: one torchrun on loopback")
    p.add_argument("--check", action="store_true",
                   help="only say whether namespaces can be made here (exit 0) or why not (exit 1)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    args = p.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command and not args.check:
        p.error("missing the training script: ... -- SCRIPT [ARGS...]")
    if args.hosts < 1 or args.ranks_per_host < 1:
        p.error("--hosts and --ranks-per-host must be >= 1")
    if args.hosts > 250:
        p.error("--hosts must be <= 250 (one /24)")
    args.rates = {k: args.bandwidth for k in range(args.hosts)}
    for item in args.host_bandwidth:
        host, _, rate = item.partition("=")
        if not host.isdigit() or not 0 <= int(host) < args.hosts:
            p.error(f"--host-bandwidth {item}: K must be a host index in 0..{args.hosts - 1}")
        args.rates[int(host)] = rate
    for rate in set(args.rates.values()):
        if rate.lower() != "none" and not RATE_RE.match(rate):
            p.error(f"bad rate {rate!r}: use tc syntax like 2gbit, 200mbit, 50mbps, or none")
    if (args.kill_host is None) != (args.after is None):
        p.error("--kill-host and --after go together")
    if args.kill_host is not None and not 0 <= args.kill_host < args.hosts:
        p.error(f"--kill-host must be in 0..{args.hosts - 1}")
    return args


# --- the namespaces ---------------------------------------------------------------------------

def ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, check=check)


def namespaces() -> List[str]:
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def kill_namespace_processes(ns: str) -> None:
    """Every process inside ns, whatever its session: torchrun starts its workers in sessions
    of their own, so killing torchrun's process group would leave them running."""
    for _ in range(5):
        pids = [int(p) for p in ip("netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def delete_namespace(ns: str) -> None:
    kill_namespace_processes(ns)
    ip("netns", "del", ns, check=False)


def sweep_stale() -> None:
    """Delete namespaces left by an emucluster that died without cleaning up (SIGKILL)."""
    for ns in namespaces():
        m = re.match(rf"^{PREFIX}(\d+)-", ns)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            delete_namespace(ns)


class Topology:
    """N host namespaces, each with eth0 = 10.77.0.(K+1), cabled to a bridge in a switch namespace."""

    def __init__(self, hosts: int, rates: Dict[int, str]):
        self.tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.hosts = [f"{self.tag}-h{k}" for k in range(hosts)]
        self.rates = rates
        self.created: List[str] = []

    def addr(self, k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    def build(self) -> None:
        for ns in [self.switch, *self.hosts]:
            ip("netns", "add", ns)
            self.created.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")  # ranks of one host rendezvous over lo
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for k, ns in enumerate(self.hosts):
            port = f"p{k}"
            # created straight inside the namespaces, so no name ever appears in the root namespace
            ip("link", "add", "name", HOST_IFACE, "netns", ns, "type", "veth", "peer", "name", port,
               "netns", self.switch)
            ip("-n", self.switch, "link", "set", port, "master", "br0")
            ip("-n", self.switch, "link", "set", port, "up")
            ip("-n", ns, "addr", "add", f"{self.addr(k)}/24", "dev", HOST_IFACE)
            ip("-n", ns, "link", "set", HOST_IFACE, "up")
            if self.rates[k].lower() != "none":
                # both directions of the host's link: its egress, and the switch port's egress to it
                for where, dev in ((ns, HOST_IFACE), (self.switch, port)):
                    subprocess.run(["ip", "netns", "exec", where, "tc", "qdisc", "replace", "dev", dev, "root",
                                    "tbf", "rate", self.rates[k], "burst", BURST, "latency", "100ms"],
                                   capture_output=True, text=True, check=True)

    def destroy(self) -> None:
        for ns in reversed(self.created):
            delete_namespace(ns)
        self.created.clear()


# --- the job ----------------------------------------------------------------------------------

def why_no_namespaces() -> Optional[str]:
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    res = ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        return f"cannot create network namespaces ({res.stderr.strip() or 'ip netns add failed'})"
    ip("netns", "del", probe, check=False)
    return None


def job_env() -> Dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    # every host must name the run the same (config.run_id); the hosts' torchruns start apart
    env.setdefault("MEGAREPRO_RUN_ID", "emucluster-" + datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S"))
    return env


def torchrun(*argv: str) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", *argv]


WORKER_EXIT_RE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


def exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


class Host:
    """One torchrun and the thread that streams its output, prefixed with the host's label."""

    def __init__(self, label: str, cmd: List[str], env: Dict[str, str], log: Optional[Path]):
        self.label, self.log = label, log
        self.worker_codes: List[int] = []
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, errors="replace", start_new_session=True)
        self.pump = threading.Thread(target=self._stream, daemon=True)
        self.pump.start()

    def _stream(self) -> None:
        sink = open(self.log, "w") if self.log else None
        for line in self.proc.stdout:
            sys.stdout.write(f"[{self.label}] {line}")
            sys.stdout.flush()
            if sink:
                sink.write(line)
                sink.flush()
            m = WORKER_EXIT_RE.match(line)
            if m:
                self.worker_codes.append(exit_code(int(m.group(1))))
        if sink:
            sink.close()

    def code(self) -> Optional[int]:
        """None while running. torchrun exits 1 whatever its workers exited with; their own codes
        are in its failure summary, so a script's exit 3 stays 3 (a host we kill stays 137)."""
        rc = self.proc.poll()
        if rc is None:
            return None
        self.pump.join(timeout=5)  # the summary is the last thing torchrun prints
        if rc == 1 and self.worker_codes:
            return max(self.worker_codes)
        return exit_code(rc)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


class Terminated(Exception):
    pass


def on_signal(signum, frame):
    raise Terminated(signum)


def supervise(args, hosts: List[Host], kill_host=lambda k: None, kill_all=lambda: None) -> int:
    """Wait for every host; apply --kill-host, --timeout and --grace; return the worst exit code."""
    start, first_failure, host_killed, survivors_killed = time.monotonic(), None, False, False
    codes: Dict[int, int] = {}
    while len(codes) < len(hosts):
        now = time.monotonic() - start
        for k, host in enumerate(hosts):
            code = None if k in codes else host.code()
            if code is not None:
                codes[k] = code
                if code != 0 and first_failure is None:
                    first_failure = now
        if args.kill_host is not None and not host_killed and now >= args.after:
            print(f"emucluster: killing host h{args.kill_host} after {args.after:g} s", flush=True)
            kill_host(args.kill_host)
            host_killed = True
        if args.timeout is not None and now >= args.timeout:
            print(f"emucluster: timeout after {args.timeout:g} s; killing every host", flush=True)
            kill_all()
            return 124
        if first_failure is not None and not survivors_killed and now - first_failure >= args.grace \
                and len(codes) < len(hosts):
            # as srun --kill-on-bad-exit: survivors of a failed host can wait in a collective for ages
            print(f"emucluster: a host failed {args.grace:g} s ago; killing the others", flush=True)
            kill_all()
            survivors_killed = True
        time.sleep(0.05)
    if len(hosts) > 1:
        print("emucluster: exit codes " + ", ".join(f"{hosts[k].label}={codes[k]}" for k in sorted(codes)),
              flush=True)
    return max(codes.values())


def run_loopback(args, reason: str) -> int:
    ranks = args.hosts * args.ranks_per_host
    print(f"emucluster: {reason}; running one torchrun with {ranks} ranks on loopback instead "
          "(no links, no bandwidth limits)", flush=True)
    env = dict(job_env(), EMUCLUSTER_HOST="lo", EMUCLUSTER_FABRIC="loopback")
    host = Host("lo", torchrun("--standalone", "--nproc_per_node", str(ranks), *args.command), env,
                args.rundir / "host0.log" if args.rundir else None)

    def stop():
        # SIGTERM first: torchrun forwards it to its workers, which run in sessions of their own
        if host.proc.poll() is None:
            os.killpg(host.proc.pid, signal.SIGTERM)
            try:
                host.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                host.kill()
    args.kill_host = None  # there is no host to lose on loopback
    try:
        return supervise(args, [host], kill_all=stop)
    finally:
        ignore_signals()
        stop()


def run_hosts(args, topo: Topology, hosts: List[Host]) -> int:
    """Start one torchrun per host namespace (appending to hosts), stream them, return the worst code."""
    env = job_env()
    for k, ns in enumerate(topo.hosts):
        cmd = ["ip", "netns", "exec", ns, *torchrun(
            "--nnodes", str(args.hosts), "--nproc_per_node", str(args.ranks_per_host), "--node_rank", str(k),
            "--master_addr", topo.addr(0), "--master_port", str(MASTER_PORT), *args.command)]
        # study.fabric (config.yaml reads it): what the tables group runs by
        fabric = f"emulated:{args.hosts}x{args.ranks_per_host}@" + "/".join(sorted(set(args.rates.values())))
        hosts.append(Host(f"h{k}", cmd, dict(env, GLOO_SOCKET_IFNAME=HOST_IFACE, EMUCLUSTER_HOST=f"h{k}",
                                             EMUCLUSTER_FABRIC=fabric),
                          args.rundir / f"host{k}.log" if args.rundir else None))

    def kill_all():
        for ns in topo.hosts:
            kill_namespace_processes(ns)
    return supervise(args, hosts, kill_host=lambda k: kill_namespace_processes(topo.hosts[k]), kill_all=kill_all)


def ignore_signals() -> None:
    """While cleaning up: a second Ctrl-C must not leave namespaces or processes behind."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)


def run_emulated(args) -> int:
    sweep_stale()
    topo = Topology(args.hosts, args.rates)
    hosts: List[Host] = []
    try:
        topo.build()
        links = ", ".join(f"h{k}={topo.addr(k)}@{args.rates[k]}" for k in range(args.hosts))
        print(f"emucluster: {args.hosts} hosts x {args.ranks_per_host} ranks: {links}", flush=True)
        return run_hosts(args, topo, hosts)
    except subprocess.CalledProcessError as e:
        print(f"emucluster: setting up the namespaces failed: {' '.join(e.cmd)}: {e.stderr.strip()}",
              file=sys.stderr, flush=True)
        return 1
    finally:
        ignore_signals()
        for host in hosts:  # one caught between fork and entering its namespace escapes topo.destroy
            host.kill()
        topo.destroy()
        for host in hosts:
            host.proc.wait()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rundir:
        args.rundir.mkdir(parents=True, exist_ok=True)
    # SIGINT too: a shell starts background jobs with it ignored, and Ctrl-C must still clean up
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)
    if args.check:
        reason = why_no_namespaces()
        print(f"emucluster: {reason or 'network namespaces available'}", flush=True)
        return 1 if reason else 0
    try:
        reason = "--loopback given" if args.loopback else why_no_namespaces()
        return run_loopback(args, reason) if reason else run_emulated(args)
    except Terminated as e:
        signum = e.args[0]
        print(f"emucluster: interrupted ({signal.Signals(signum).name}); cleaned up", file=sys.stderr, flush=True)
        return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
