#!/usr/bin/env bash
# N hosts emulated on this machine, for hyparflow's cross-host tests (root, Linux).
#
#   bash scripts/emulated-cluster.sh up N [--slurm]   # N hosts on a bridge (+ Slurm, one slurmd each)
#   bash scripts/emulated-cluster.sh status           # the hosts; exit 0 when all answer
#   bash scripts/emulated-cluster.sh env              # the exports that point mpiexec (and Slurm) at them
#   bash scripts/emulated-cluster.sh cut HOST | heal HOST   # take a host's link down / up
#   bash scripts/emulated-cluster.sh rate RATE|off    # limit every host's link to RATE (e.g. 100mbit) now
#   bash scripts/emulated-cluster.sh exec HOST CMD... # run CMD on HOST (what mpiexec does)
#   bash scripts/emulated-cluster.sh down             # remove everything `up` made
#
# Each host is a Linux network namespace named like the host (hfnode1, hfnode2, ...: prefix
# $HYPARFLOW_EMU_PREFIX) with one veth link to the bridge hfbr0 ($HYPARFLOW_EMU_BRIDGE) and its own address
# 10.213.0.(10+i)/24; this machine is 10.213.0.1 on the bridge. Traffic between hosts is real
# TCP through the kernel, so a host can be cut off (`cut`: its link down, no TCP reset, as a
# dead switch port or a frozen node looks to the others). Programs run "on" a host through
# `nsenter --net=/run/netns/HOST unshare --uts` with the host name set: they share this
# machine's files and processes (a venv and a worktree are the same paths everywhere).
#
# MPICH's mpiexec (hydra) launches into the hosts with `-launcher ssh -launcher-exec
# $DIR/enter-host` (that script stands in for ssh) and `-iface hfbr0`; `env` prints the
# HYDRA_* variables that do the same without flags, and HYPARFLOW_EMULATED_HOSTS (the host
# list, which the tests look for); Open MPI's mpiexec the same through OMPI_MCA_plm_rsh_agent
# and OMPI_MCA_*_tcp_if_include. $HYPARFLOW_EMU_RATE (e.g. 1gbit) limits each host's link
# both ways with `tc ... tbf` (this kernel has no netem), with a bucket of
# $HYPARFLOW_EMU_BURST (default 32kb): a larger bucket lets every message up to its size
# through at the bridge's speed once the link has been idle (256kb made 256 KB messages
# cross a "1 Gbit/s" link 40% faster than 1 Gbit/s allows).
#
# --slurm (or HYPARFLOW_EMU_SLURM=1) adds a Slurm cluster: slurmctld on this machine (on the
# bridge address, port $HYPARFLOW_EMU_SLURM_PORT, default 6837) and one slurmd per host,
# each started in its host's namespace. Debian's slurm-wlm is installed with apt-get if absent.
#
# State lives under $HYPARFLOW_EMU_DIR (default /tmp/hyparflow-emu); `down` removes only the
# namespaces, links and daemons recorded there. `up` is idempotent.
set -euo pipefail

DIR="${HYPARFLOW_EMU_DIR:-/tmp/hyparflow-emu}"
PREFIX="${HYPARFLOW_EMU_PREFIX:-hfnode}"
BRIDGE="${HYPARFLOW_EMU_BRIDGE:-hfbr0}"
NET="${HYPARFLOW_EMU_NET:-10.213.0}"   # a private /24 used only between these namespaces
RATE="${HYPARFLOW_EMU_RATE:-}"
SLURM_PORT="${HYPARFLOW_EMU_SLURM_PORT:-6837}"
HOSTS_FILE="$DIR/hosts"        # one "name address" per line
PIDS="$DIR/daemons.pids"       # "name pid" per daemon started here
CONF="$DIR/slurm/slurm.conf"
PATH="$PATH:/usr/sbin:/sbin"

say() { echo "emulated-cluster: $*" >&2; }
die() { say "error: $*"; exit 1; }

hosts() { [ -f "$HOSTS_FILE" ] && awk '{print $1}' "$HOSTS_FILE" || true; }
address() { awk -v h="$1" '$1 == h {print $2}' "$HOSTS_FILE"; }
veth() { echo "${BRIDGE}v${1#"$PREFIX"}"; }   # a host's link, on the bridge side
known() { [ -f "$HOSTS_FILE" ] && [ -n "$(address "$1")" ] || die "no host $1 (hosts: $(hosts | xargs))"; }

# The stand-in for ssh that hydra (and Open MPI) call: `enter-host [ssh options] HOST COMMAND...`.
write_launcher() {
    cat > "$DIR/enter-host" <<'EOF'
#!/bin/sh
# hydra's "ssh": skip its options, then run the command in HOST's network namespace with
# HOST as the host name (as ssh would run it in a shell on HOST).
while [ $# -gt 0 ]; do
    case "$1" in
        -[1246AaCfGgKkMNnqsTtVvXxYy]) shift ;;
        -*) shift; [ $# -gt 0 ] && shift ;;   # an option with a value (-o X, -p N, ...)
        *) break ;;
    esac
done
host="$1"; shift
[ -e "/run/netns/$host" ] || { echo "enter-host: no host $host" >&2; exit 255; }
case "$*" in
    # Settings before the command (Open MPI's `PATH=...; export PATH; ... orted ...` with
    # -x PATH), or quoted semicolons: run the line as ssh's remote shell would.
    *";"*) exec nsenter --net="/run/netns/$host" unshare --uts sh -c "hostname $host && $*" ;;
    *) exec nsenter --net="/run/netns/$host" unshare --uts sh -c "hostname $host && exec $*" ;;
esac
EOF
    chmod 755 "$DIR/enter-host"
}

limit_rate() {   # tbf on device $1 (run with the prefix in $2, e.g. "ip netns exec h")
    local dev="$1"; shift
    [ -n "$RATE" ] || return 0
    "$@" tc qdisc replace dev "$dev" root tbf rate "$RATE" burst "${HYPARFLOW_EMU_BURST:-32kb}" latency 50ms
}

make_host() {
    local i="$1" name="$PREFIX$1" addr="$NET.$((10 + $1))"
    ip netns add "$name"
    echo "$name $addr" >> "$HOSTS_FILE"
    ip link add "$(veth "$name")" type veth peer name "${BRIDGE}p$i"
    ip link set "${BRIDGE}p$i" netns "$name"
    ip link set "$(veth "$name")" master "$BRIDGE" up
    ip -n "$name" link set "${BRIDGE}p$i" name eth0
    ip -n "$name" addr add "$addr/24" dev eth0
    ip -n "$name" link set eth0 up
    ip -n "$name" link set lo up
    limit_rate "$(veth "$name")"              # into the host
    limit_rate eth0 ip netns exec "$name"    # out of the host
}

net_up() {
    local n="$1" i
    if [ -f "$HOSTS_FILE" ] && [ "$(hosts | wc -l)" -eq "$n" ] \
            && ip link show "$BRIDGE" >/dev/null 2>&1 && reachable; then
        say "network already up: $(hosts | xargs)"
        write_launcher   # this checkout's
        # The rate asked for now, not the one of the first `up` (which would go unsaid).
        if [ -n "$RATE" ]; then set_rate "$RATE"; fi
        return 0
    fi
    net_down
    mkdir -p "$DIR"
    : > "$HOSTS_FILE"
    ip link add "$BRIDGE" type bridge
    echo "bridge $BRIDGE" > "$DIR/bridge"
    ip addr add "$NET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for i in $(seq "$n"); do make_host "$i"; done
    write_launcher
    for i in $(seq 50); do reachable && break; sleep 0.1; done
    reachable || die "the hosts do not answer each other (ping); see \`ip -br addr\`"
    say "hosts up: $(sed 's/ /=/' "$HOSTS_FILE" | xargs)${RATE:+, links limited to $RATE}"
}

# Every host reaches every other host and this machine: a TCP connection to port 9 (discard)
# is answered at once, by a reset when nothing listens; only an unreachable address times out.
reachable() {
    local h a code
    for h in $(hosts); do
        for a in $NET.1 $(awk '{print $2}' "$HOSTS_FILE"); do
            code=0
            nsenter --net="/run/netns/$h" timeout 2 bash -c "exec 3<>/dev/tcp/$a/9" \
                >/dev/null 2>&1 || code=$?
            [ "$code" -ne 124 ] || return 1
        done
    done
}

net_down() {
    local h pid
    for h in $(hosts); do
        # Programs still running on the host would keep its namespace alive: end them.
        for pid in $(ip netns pids "$h" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
        ip netns del "$h" 2>/dev/null || true
        ip link del "$(veth "$h")" 2>/dev/null || true
    done
    [ -f "$DIR/bridge" ] && ip link del "$BRIDGE" 2>/dev/null || true
    rm -f "$HOSTS_FILE" "$DIR/bridge" "$DIR/enter-host"
}

# ---------------------------------------------------------------- Slurm (optional)

slurm_install() {
    command -v slurmd >/dev/null && command -v slurmctld >/dev/null && command -v munged >/dev/null \
        && return 0
    command -v apt-get >/dev/null || die "no slurmd/slurmctld/munged and no apt-get"
    say "installing slurm-wlm and munge with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >&2
    apt-get install -y -q --no-install-recommends slurm-wlm munge >&2
}

live_pid() {
    local pid
    [ -f "$PIDS" ] || return 1
    pid="$(awk -v n="$1" '$1 == n {print $2}' "$PIDS" | tail -n 1)"
    [ -n "$pid" ] && [ -d "/proc/$pid" ] && echo "$pid"
}

start_daemon() {   # name pidfile command...
    local name="$1" pidfile="$2" i
    shift 2
    rm -f "$pidfile"
    "$@" || die "$name did not start; see $DIR/slurm/log/"
    for i in $(seq 50); do [ -s "$pidfile" ] && break; sleep 0.1; done
    [ -s "$pidfile" ] || die "$name wrote no pid file $pidfile; see $DIR/slurm/log/"
    echo "$name $(cat "$pidfile")" >> "$PIDS"
}

slurm_conf() {
    local plugins mpi=none d cpus mem
    for d in /usr/lib/*/slurm-wlm /usr/lib/slurm-wlm /usr/lib64/slurm /usr/lib/slurm; do
        [ -e "$d/mpi_pmi2.so" ] && mpi=pmi2
    done
    cpus="${HYPARFLOW_EMU_CPUS:-2}"     # per host; the hosts share this machine's cores
    mem=$(awk '/MemTotal/ {print int($2 / 1024 / 4)}' /proc/meminfo)
    cat > "$CONF" <<EOF
# Written by hyparflow's scripts/emulated-cluster.sh: one slurmd per emulated host.
ClusterName=hyparflowemu
# Job ids of their own: MPICH names its shared-memory segments after the PMI job (id.step),
# and a segment a killed job left behind must not meet a job of the one-node cluster.
FirstJobId=100000
SlurmctldHost=localhost($NET.1)
SlurmctldPort=$SLURM_PORT
SlurmdPort=$((SLURM_PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: also how long a requeued job waits before it may start again (default
# 120 s); the 2-node requeue test waits for it.
AuthInfo=socket=$DIR/slurm/run/munge.socket,cred_expire=10
StateSaveLocation=$DIR/slurm/state
SlurmdSpoolDir=$DIR/slurm/spool/%n
SlurmctldPidFile=$DIR/slurm/run/slurmctld.pid
SlurmdPidFile=$DIR/slurm/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurm/log/slurmctld.log
SlurmdLogFile=$DIR/slurm/log/slurmd-%n.log
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
KillWait=5
MinJobAge=300
SlurmdParameters=config_overrides
EOF
    while read -r h a; do
        echo "NodeName=$h NodeAddr=$a CPUs=$cpus Boards=1 SocketsPerBoard=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=$mem State=UNKNOWN" >> "$CONF"
    done < "$HOSTS_FILE"
    echo "PartitionName=emu Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$CONF"
}

slurm_idle() {
    local states
    states="$(SLURM_CONF="$CONF" timeout 10 sinfo -h -N -o '%T' 2>/dev/null | sort -u | xargs)"
    [ "$states" = idle ]
}

slurm_up() {
    if live_pid slurmctld >/dev/null && slurm_idle; then
        say "slurm already up ($CONF)"
        return 0
    fi
    slurm_down
    slurm_install
    rm -rf "$DIR/slurm"
    mkdir -p "$DIR"/slurm/{munge,run,state,spool,log}
    chmod 700 "$DIR/slurm/munge"
    chmod 755 "$DIR/slurm" "$DIR/slurm/run"
    if command -v mungekey >/dev/null; then
        mungekey --create --keyfile="$DIR/slurm/munge/munge.key" >&2
    else
        dd if=/dev/urandom of="$DIR/slurm/munge/munge.key" bs=1024 count=1 status=none
    fi
    chmod 600 "$DIR/slurm/munge/munge.key"
    start_daemon munged "$DIR/slurm/run/munged.pid" munged \
        --key-file="$DIR/slurm/munge/munge.key" --socket="$DIR/slurm/run/munge.socket" \
        --pid-file="$DIR/slurm/run/munged.pid" --log-file="$DIR/slurm/munge/munged.log" \
        --seed-file="$DIR/slurm/munge/munged.seed"
    slurm_conf
    start_daemon slurmctld "$DIR/slurm/run/slurmctld.pid" slurmctld -f "$CONF"
    local h
    for h in $(hosts); do
        # nsenter --net, not `ip netns exec`: the latter remounts /sys, and slurmd then
        # cannot find its cgroups.
        start_daemon "slurmd-$h" "$DIR/slurm/run/slurmd-$h.pid" \
            nsenter --net="/run/netns/$h" unshare --uts sh -c \
            "hostname $h && exec slurmd -f $CONF -N $h"
    done
    local i
    for i in $(seq 120); do slurm_idle && break; sleep 0.5; done
    if ! slurm_idle; then
        SLURM_CONF="$CONF" sinfo -N >&2 || true
        tail -n 20 "$DIR"/slurm/log/*.log >&2 || true
        die "Slurm nodes not idle after 60 s"
    fi
    say "slurm up: $(hosts | xargs) idle (SLURM_CONF=$CONF)"
}

slurm_down() {
    [ -f "$PIDS" ] || return 0
    if live_pid slurmctld >/dev/null; then
        local jobs
        jobs="$(SLURM_CONF="$CONF" timeout 10 squeue -h -o '%i' 2>/dev/null || true)"
        if [ -n "$jobs" ]; then
            # shellcheck disable=SC2086
            SLURM_CONF="$CONF" timeout 10 scancel $jobs || true
            sleep 2
        fi
    fi
    local name pid i
    for name in $(awk '{print $1}' "$PIDS" | tac); do
        pid="$(live_pid "$name")" || continue
        kill -TERM "$pid" 2>/dev/null || true
        for i in $(seq 50); do [ -d "/proc/$pid" ] || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
    done
    rm -f "$PIDS"
}

# ---------------------------------------------------------------- commands

print_env() {
    [ -f "$HOSTS_FILE" ] || die "not up (no $HOSTS_FILE)"
    echo "export HYPARFLOW_EMULATED_HOSTS=$(hosts | paste -sd, -)"
    echo "export HYPARFLOW_EMULATED_DIR=$DIR"
    echo "export HYDRA_LAUNCHER=ssh"
    echo "export HYDRA_LAUNCHER_EXEC=$DIR/enter-host"
    echo "export HYDRA_IFACE=$BRIDGE"
    # MPICH's libfabric TCP transport between hosts, over the host's link (eth0 on every
    # host). Its default, UCX, would reach the other "hosts" through shared memory (one
    # kernel, one /dev/shm), and its long addresses overflow Slurm 22.05's PMI-2 messages
    # now and then ("mpi/pmi2: value not properly terminated"). Ranks on one host still
    # share memory through MPICH's own shm, which goes by host name.
    echo "export MPIR_CVAR_CH4_NETMOD=ofi"
    echo "export FI_PROVIDER=tcp"
    echo "export FI_TCP_IFACE=eth0"
    # Open MPI's mpiexec: the same stand-in for ssh (its rsh launcher), and its daemons'
    # and ranks' TCP on the bridge's network (each host's eth0, this machine's bridge).
    echo "export OMPI_MCA_plm_rsh_agent=$DIR/enter-host"
    echo "export OMPI_MCA_oob_tcp_if_include=$NET.0/24"
    echo "export OMPI_MCA_btl_tcp_if_include=$NET.0/24"
    if [ -f "$PIDS" ] && live_pid slurmctld >/dev/null; then echo "export SLURM_CONF=$CONF"; fi
}

up() {
    local n="${1:-}" slurm="${HYPARFLOW_EMU_SLURM:-0}"
    [ "${2:-}" = --slurm ] && slurm=1
    [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 64 ] \
        || die "give the number of hosts (1-64), e.g. \`$0 up 2\`"
    [ "$(id -u)" -eq 0 ] || die "needs root (network namespaces, links)"
    command -v nsenter >/dev/null && command -v unshare >/dev/null || die "needs util-linux's nsenter and unshare"
    net_up "$n"
    [ "$slurm" = 1 ] && slurm_up
    print_env
}

status() {
    [ -f "$HOSTS_FILE" ] || { say "not up"; return 1; }
    local ok=0
    reachable || { say "hosts do not all answer"; ok=1; }
    say "hosts: $(sed 's/ /=/' "$HOSTS_FILE" | xargs)"
    if [ -f "$PIDS" ]; then SLURM_CONF="$CONF" sinfo -N >&2 || ok=1; fi
    [ $ok -eq 0 ] && print_env
    return $ok
}

set_rate() {   # every host's link, both ways, without taking anything down
    local h
    [ -n "${1:-}" ] || die "give a rate (e.g. 1gbit, 100mbit) or off"
    [ -f "$HOSTS_FILE" ] || die "not up (no $HOSTS_FILE)"
    for h in $(hosts); do
        if [ "$1" = off ]; then
            tc qdisc del dev "$(veth "$h")" root 2>/dev/null || true
            ip netns exec "$h" tc qdisc del dev eth0 root 2>/dev/null || true
        else
            RATE="$1" limit_rate "$(veth "$h")"
            RATE="$1" limit_rate eth0 ip netns exec "$h"
        fi
    done
    say "links of $(hosts | xargs): ${1/off/unlimited}"
}

cmd="${1:-}"
shift || true
case "$cmd" in
    up) up "$@" ;;
    down) slurm_down; net_down; say "down" ;;
    status) status ;;
    env) print_env ;;
    cut) known "$1"; ip link set "$(veth "$1")" down; say "cut $1" ;;
    heal) known "$1"; ip link set "$(veth "$1")" up; say "healed $1" ;;
    rate) set_rate "${1:-}" ;;
    exec) known "$1"; h="$1"; shift; exec nsenter --net="/run/netns/$h" unshare --uts sh -c "hostname $h && exec \"\$@\"" sh "$@" ;;
    *) echo "usage: $0 up N [--slurm] | down | status | env | cut HOST | heal HOST | rate RATE|off | exec HOST CMD..." >&2
       exit 2 ;;
esac
