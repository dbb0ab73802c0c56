#!/usr/bin/env bash
# A single-node SLURM cluster on this machine, for tests, CI, and trying the sbatch/srun path.
#
#   experiments/slurm/local_cluster.sh start    # install (if missing), configure, start; idempotent
#   experiments/slurm/local_cluster.sh status   # is it up, and which daemons did this script start
#   experiments/slurm/local_cluster.sh stop     # stop only the daemons this script started
#
# Debian's slurm-wlm, one node, one partition (debug). There is no systemd in CI containers, so
# the daemons are started by hand and their pids are kept in $STATE_DIR/pids; stop kills those
# pids and nothing else, so a SLURM or munge that was already running is left alone.
# Needs root (it installs packages and writes /etc/slurm/slurm.conf). Each command prints one
# line saying what happened, and exits non-zero on failure; details go to $STATE_DIR/*.log.
# With more tasks than cores a job waits forever: submit with --overcommit.
set -u -o pipefail

STATE_DIR=${LOCAL_SLURM_STATE_DIR:-/run/megarepro-local-slurm}
CONF=/etc/slurm/slurm.conf
MARKER="# written by megarepro experiments/slurm/local_cluster.sh"
WAIT_S=${LOCAL_SLURM_WAIT_S:-30}
NODE=$(hostname -s)

say() { echo "local_cluster: $*"; }
fail() { echo "local_cluster: FAILED: $*" >&2; exit 1; }

# a pid recorded earlier still alive and still the same program (pids get reused)
alive() { [ -n "$1" ] && [ "$(cat /proc/"$1"/comm 2>/dev/null)" = "$2" ]; }
recorded_pid() { awk -v n="$1" '$1 == n { print $2 }' "$STATE_DIR/pids" 2>/dev/null; }
record() { echo "$1 $2" >> "$STATE_DIR/pids"; }

# sinfo retries for ~10 s when no controller answers: ask only when one is running, and briefly
node_state() {
    pgrep -x slurmctld >/dev/null || return 0
    timeout 5 sinfo -h -N -n "$NODE" -o %T 2>/dev/null | head -n1
}
is_up() { case $1 in idle|mixed|allocated|completing) return 0 ;; *) return 1 ;; esac; }

install_packages() {
    command -v slurmd >/dev/null && command -v slurmctld >/dev/null && command -v munged >/dev/null && return 0
    say "installing slurm-wlm and munge (apt-get; log in $STATE_DIR/apt.log)" >&2
    { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        slurm-wlm munge; } > "$STATE_DIR/apt.log" 2>&1 || fail "apt-get install slurm-wlm munge (see $STATE_DIR/apt.log)"
}

start_munge() {
    # a working munged, ours or not, is all SLURM needs
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    if [ ! -s /etc/munge/munge.key ]; then
        (umask 077; dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null)
        chown munge:munge /etc/munge/munge.key
    fi
    su -s /bin/sh munge -c /usr/sbin/munged >> "$STATE_DIR/daemons.log" 2>&1 || fail "munged did not start (see $STATE_DIR/daemons.log)"
    record munged "$(cat /run/munge/munged.pid)"
}

write_conf() {
    if [ -f "$CONF" ] && ! grep -qF "$MARKER" "$CONF"; then
        fail "$CONF exists and was not written by this script; move it away to use the local cluster"
    fi
    # slurmd -C prints this machine's NodeName line; keep RealMemory a little below the machine's
    # so the node is not drained for having less memory than it claims
    local node_line mem cpus
    node_line=$(slurmd -C | grep '^NodeName=') || fail "slurmd -C printed no NodeName line"
    mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<< "$node_line")
    cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<< "$node_line")
    mem=$(( mem * 95 / 100 ))
    node_line=$(sed "s/RealMemory=[0-9]*/RealMemory=$mem/" <<< "$node_line")
    mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
    cat > "$CONF" <<EOF
$MARKER
ClusterName=local
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# without a default, a job that asks no memory takes the whole node and jobs run one at a time
DefMemPerCPU=$(( mem / cpus ))
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
$node_line
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

start_daemon() {  # name, pid file, command...
    local name=$1 pidfile=$2; shift 2
    alive "$(cat "$pidfile" 2>/dev/null)" "$name" && return 0
    "$@" >> "$STATE_DIR/daemons.log" 2>&1 || fail "$name did not start (see $STATE_DIR/daemons.log and /var/log/slurm/$name.log)"
    for _ in $(seq 50); do [ -s "$pidfile" ] && break; sleep 0.1; done
    alive "$(cat "$pidfile" 2>/dev/null)" "$name" || fail "$name exited at start (see /var/log/slurm/$name.log)"
    record "$name" "$(cat "$pidfile")"
}

cmd_start() {
    [ "$(id -u)" = 0 ] || fail "needs root (it installs packages and writes $CONF)"
    mkdir -p "$STATE_DIR"
    local state
    state=$(node_state)
    if is_up "$state"; then
        say "already up: node $NODE is $state, partition debug"
        return 0
    fi
    install_packages
    start_munge
    # rewrite the conf only when no slurmctld is using it
    alive "$(cat /run/slurmctld.pid 2>/dev/null)" slurmctld || write_conf
    start_daemon slurmctld /run/slurmctld.pid /usr/sbin/slurmctld -i
    start_daemon slurmd /run/slurmd.pid /usr/sbin/slurmd
    local deadline=$(( SECONDS + WAIT_S ))
    until state=$(node_state); is_up "$state"; do
        [ $SECONDS -lt $deadline ] || fail "node $NODE is '${state:-not listed}' after ${WAIT_S}s (see /var/log/slurm/slurmctld.log, slurmd.log)"
        sleep 0.2
    done
    say "up: node $NODE ($(sinfo -h -N -n "$NODE" -o '%c CPUs, %m MB'), $state), partition debug; stop with $0 stop"
}

cmd_stop() {
    if [ ! -s "$STATE_DIR/pids" ]; then
        say "nothing to stop: this script started no daemons (state: $STATE_DIR/pids)"
        return 0
    fi
    local stopped=() name pid
    for name in slurmd slurmctld munged; do  # the reverse of the start order
        pid=$(recorded_pid "$name")
        alive "$pid" "$name" || continue
        kill -TERM "$pid"
        for _ in $(seq 50); do alive "$pid" "$name" || break; sleep 0.2; done
        alive "$pid" "$name" && kill -KILL "$pid"
        stopped+=("$name($pid)")
    done
    rm -f "$STATE_DIR/pids"
    say "stopped ${stopped[*]:-nothing (the recorded daemons had already exited)}"
}

cmd_status() {
    local ours=() name pid state
    for name in munged slurmctld slurmd; do
        pid=$(recorded_pid "$name")
        alive "$pid" "$name" && ours+=("$name($pid)")
    done
    state=$(node_state)
    if is_up "$state"; then
        say "up: node $NODE is $state; started by this script: ${ours[*]:-none}"
    else
        say "down: node $NODE is '${state:-not listed}'; started by this script: ${ours[*]:-none}"
        return 1
    fi
}

case ${1:-} in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
