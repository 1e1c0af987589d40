#!/usr/bin/env bash
# A throw-away one-node Slurm cluster on this machine, for hyparflow's Slurm tests.
#
#   bash scripts/slurm-cluster.sh up       # install (Debian, root), configure, start, wait idle
#   bash scripts/slurm-cluster.sh status   # daemons and sinfo; exit 0 when the node answers
#   bash scripts/slurm-cluster.sh down     # cancel its jobs, stop the daemons it started
#
# Everything lives under $HYPARFLOW_SLURM_DIR (default /tmp/hyparflow-slurm): slurm.conf,
# its own munge key and socket, state, spool, logs, pid files. Nothing in /etc is changed,
# and system daemons are left alone: `down` stops only the pids that `up` recorded.
# `up` prints `export SLURM_CONF=...` on stdout (progress goes to stderr), so
#
#   eval "$(bash scripts/slurm-cluster.sh up)"
#
# leaves sinfo/sbatch/srun pointed at this cluster. Ports: $HYPARFLOW_SLURM_PORT (slurmctld,
# default 6817) and the next one (slurmd).
#
# The node is declared with this machine's CPUs and memory. HYPARFLOW_SLURM_CPUS=N declares
# N CPUs instead when N is larger (slurmd then trusts the config: SlurmdParameters=
# config_overrides): Slurm 22.05 refuses --ntasks-per-node above a node's CPUs even with
# --overcommit, so a 2-core machine needs it to run a 4-ranks-per-node job.
set -euo pipefail

DIR="${HYPARFLOW_SLURM_DIR:-/tmp/hyparflow-slurm}"
CONF="$DIR/slurm.conf"
PIDS="$DIR/daemons.pids"      # "name pid" per daemon this script started
PORT="${HYPARFLOW_SLURM_PORT:-6817}"
NODE="$(hostname -s)"
WAIT="${HYPARFLOW_SLURM_WAIT:-60}"   # seconds to wait for the node to be idle
PATH="$PATH:/usr/sbin:/sbin"

say() { echo "slurm-cluster: $*" >&2; }
die() { say "error: $*"; exit 1; }

install_packages() {
    local missing=()
    for tool in slurmctld slurmd sinfo sbatch srun scontrol; do
        command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
    done
    command -v munged >/dev/null 2>&1 || missing+=(munged)
    command -v mungekey >/dev/null 2>&1 || command -v create-munge-key >/dev/null 2>&1 \
        || missing+=(mungekey)
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        die "missing ${missing[*]}; install the Debian/Ubuntu packages slurm-wlm and munge" \
            "(as root: apt-get install slurm-wlm munge) and run this again"
    fi
    say "installing slurm-wlm and munge with apt-get (missing: ${missing[*]})"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >&2
    apt-get install -y -q --no-install-recommends slurm-wlm munge >&2
}

# CPUs=... Boards=... RealMemory=... of this machine, as slurmd measures them.
hardware() {
    local line
    line="$(slurmd -C 2>/dev/null | head -n 1 || true)"
    if [[ "$line" == NodeName=* ]]; then
        echo "${line#NodeName=* }"
    else
        echo "CPUs=$(nproc --all) RealMemory=$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)"
    fi
}

# The node's line: the hardware, or HYPARFLOW_SLURM_CPUS CPUs when that is more.
node_resources() {
    local hw cpus want="${HYPARFLOW_SLURM_CPUS:-}"
    hw="$(hardware)"
    cpus="$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<< "$hw")"
    if [[ "$want" =~ ^[0-9]+$ ]] && [ "$want" -gt "${cpus:-0}" ]; then
        say "declaring $want CPUs (the hardware has ${cpus:-?}): HYPARFLOW_SLURM_CPUS"
        echo "CPUs=$want Boards=1 SocketsPerBoard=1 CoresPerSocket=$want ThreadsPerCore=1" \
             "$(grep -o 'RealMemory=[0-9]*' <<< "$hw")"
    else
        echo "$hw"
    fi
}

plugin_dir() {
    local d
    for d in /usr/lib/*/slurm-wlm /usr/lib/slurm-wlm /usr/lib64/slurm /usr/lib/slurm \
             /usr/local/lib/slurm /usr/local/lib64/slurm; do
        [ -e "$d/select_cons_tres.so" ] && { echo "$d"; return 0; }
    done
    return 1
}

write_conf() {
    local user mpi=none plugins resources extra="# node: this machine's CPUs and memory"
    user="$(id -un)"
    resources="$(node_resources)"
    if [ "$resources" != "$(hardware)" ]; then
        extra="SlurmdParameters=config_overrides   # node: more CPUs than the hardware"
    fi
    if plugins="$(plugin_dir)" && [ -e "$plugins/mpi_pmi2.so" ]; then mpi=pmi2; fi
    cat > "$CONF" <<EOF
# Written by hyparflow's scripts/slurm-cluster.sh: a one-node test cluster on loopback.
ClusterName=hyparflow
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/run/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=$mpi
SwitchType=switch/none
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
MinJobAge=300
$extra
NodeName=$NODE NodeAddr=127.0.0.1 $resources State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

# The pid recorded for daemon $1 if that process is still that daemon.
live_pid() {
    local name="$1" pid
    [ -f "$PIDS" ] || return 1
    pid="$(awk -v n="$name" '$1 == n {print $2}' "$PIDS" | tail -n 1)"
    [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$name" ] \
        && echo "$pid"
}

node_state() {
    SLURM_CONF="$CONF" timeout 10 sinfo -h -n "$NODE" -o '%T' 2>/dev/null | head -n 1
}

# Start daemon $1 (which writes pid file $2) with arguments $3...; record its pid.
start_daemon() {
    local name="$1" pidfile="$2" i
    shift 2
    rm -f "$pidfile"
    "$@" || die "$name did not start; see $DIR/log/ (command: $*)"
    for i in $(seq 50); do
        [ -s "$pidfile" ] && break
        sleep 0.1
    done
    [ -s "$pidfile" ] || die "$name wrote no pid file $pidfile; see $DIR/log/"
    echo "$name $(cat "$pidfile")" >> "$PIDS"
}

up() {
    if live_pid slurmctld >/dev/null && live_pid slurmd >/dev/null \
            && [ "$(node_state)" = idle ]; then
        say "already up ($CONF)"
        echo "export SLURM_CONF=$CONF"
        return 0
    fi
    stop_daemons   # leftovers of an earlier run in this directory, if any
    install_packages
    [ "$(id -u)" -eq 0 ] || say "warning: not root; slurmd normally needs root to start jobs"
    local start=$SECONDS
    # Only what this script creates: HYPARFLOW_SLURM_DIR may be a directory with other files.
    rm -rf "${DIR:?}"/{munge,run,state,spool,log} "$CONF"
    mkdir -p "$DIR"/{munge,run,state,spool,log}
    chmod 700 "$DIR/munge"          # munged: key and log private ...
    chmod 755 "$DIR" "$DIR/run"     # ... its socket reachable by all
    : > "$PIDS"

    if command -v mungekey >/dev/null 2>&1; then
        mungekey --create --keyfile="$DIR/munge/munge.key" >&2
    else
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    fi
    chmod 600 "$DIR/munge/munge.key"
    start_daemon munged "$DIR/run/munged.pid" munged --key-file="$DIR/munge/munge.key" \
        --socket="$DIR/run/munge.socket" --pid-file="$DIR/run/munged.pid" \
        --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed"

    write_conf
    export SLURM_CONF="$CONF"
    start_daemon slurmctld "$DIR/run/slurmctld.pid" slurmctld -f "$CONF"
    start_daemon slurmd "$DIR/run/slurmd.pid" slurmd -f "$CONF" -N "$NODE"

    local state="" deadline=$((SECONDS + WAIT))
    while [ $SECONDS -lt $deadline ]; do
        state="$(node_state)"
        [ "$state" = idle ] && break
        sleep 0.5
    done
    if [ "$state" != idle ]; then
        say "node $NODE is '${state:-not answering}' after ${WAIT} s; last log lines:"
        tail -n 15 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
        stop_daemons
        exit 1
    fi
    say "up in $((SECONDS - start)) s: node $NODE idle, config $CONF"
    echo "export SLURM_CONF=$CONF"
}

stop_daemons() {
    [ -f "$PIDS" ] || return 0
    local name pid i stopped=()
    if live_pid slurmctld >/dev/null; then
        # Jobs of this cluster only (its own config); their steps would outlive slurmd.
        local jobs
        jobs="$(SLURM_CONF="$CONF" timeout 10 squeue -h -o '%i' 2>/dev/null || true)"
        if [ -n "$jobs" ]; then
            say "cancelling jobs: $(echo $jobs)"
            # shellcheck disable=SC2086
            SLURM_CONF="$CONF" timeout 10 scancel $jobs || true
            for i in $(seq 30); do
                [ -z "$(SLURM_CONF="$CONF" timeout 10 squeue -h -o '%i' 2>/dev/null)" ] && break
                sleep 0.5
            done
        fi
    fi
    for name in slurmd slurmctld munged; do
        pid="$(live_pid "$name")" || continue
        kill -TERM "$pid" 2>/dev/null || true
        for i in $(seq 50); do
            [ -d "/proc/$pid" ] || break
            sleep 0.1
        done
        [ -d "/proc/$pid" ] && kill -KILL "$pid" 2>/dev/null || true
        stopped+=("$name($pid)")
    done
    rm -f "$PIDS"
    [ ${#stopped[@]} -eq 0 ] || say "stopped ${stopped[*]}"
}

down() {
    if [ ! -f "$PIDS" ]; then
        say "not running (no $PIDS)"
        return 0
    fi
    stop_daemons
}

status() {
    local name pid ok=0
    for name in munged slurmctld slurmd; do
        if pid="$(live_pid "$name")"; then
            say "$name running (pid $pid)"
        else
            say "$name not running"
            ok=1
        fi
    done
    if [ $ok -eq 0 ] && [ -f "$CONF" ]; then
        SLURM_CONF="$CONF" sinfo >&2 || ok=1
        case "$(node_state)" in idle|mixed|allocated|completing) ;; *) ok=1 ;; esac
    fi
    [ $ok -eq 0 ] && echo "export SLURM_CONF=$CONF"
    return $ok
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up|down|status   (state in \$HYPARFLOW_SLURM_DIR, default /tmp/hyparflow-slurm)" >&2
       exit 2 ;;
esac
