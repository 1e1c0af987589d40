#!/usr/bin/env bash
# CI's Open MPI tier (.ci/run calls it after the main suite): the cluster's own MPI, as a
# site gives it, passes the same contract, fault and launcher checks as pip's MPICH.
#
#   bash scripts/openmpi-tier.sh            # Debian's Open MPI, a venv of its own, the cases
#
# Open MPI from the distribution (openmpi-bin, libopenmpi-dev; apt-get when absent), and a
# second venv built as docs/cluster-mpi.md says: mpi4py compiled against it
# (MPICC=mpicc pip install --no-binary=mpi4py), the project installed, pip's `mpich`
# wheel removed. $HYPARFLOW_OMPI_VENV names that venv (kept and reused when it already
# holds an Open MPI mpi4py; default: a new one under a temporary directory).
#
# Cases (each under a time limit; every one runs, and the tier fails if any fails):
#   cli        hyparflow info and the launcher's dialect (tests/cluster/test_cli.py)
#   mpi-n2     tests/mpi under mpiexec -n 2 (tests/cluster/test_mpi.py::test_contract_under_mpiexec),
#              but its three longest cases
#   mpi-n4     at -n 4 (on 2 cores: --oversubscribe), the tests that need 4 ranks or
#              whose layouts change with them: 2x2 meshes, pipelined tables, independent
#              split branches, chunks' replicas, bfloat16 boundaries, the contract's cases,
#              the heartbeat's stop
#   faults     a raising rank, a killed rank, a frozen rank, a collective on one rank only
#   hosts      hyparflow run --hosts on 2 emulated hosts (needs root; the cluster of
#              scripts/emulated-cluster.sh, started here when CI has not)
#   two-fits   two hf.fit and an hf.evaluate in one process, against model.fit, 10 times
#              in a row (2 processes of 5 rounds: every round stops and starts heartbeats
#              and side channels, every process ends through MPI_Finalize)
# A line per case with its result and seconds, then the tier's total, end the output.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
START=$(date +%s)
VENV="${HYPARFLOW_OMPI_VENV:-$(mktemp -d)/venv-ompi}"
RUNS="${HYPARFLOW_OMPI_TWO_FITS_RUNS:-2}"       # processes, each of
ROUNDS="${HYPARFLOW_OMPI_TWO_FITS_ROUNDS:-5}"   # rounds of two fits and an evaluate

say() { echo "openmpi-tier: $*" >&2; }

# The tier runs its venv's python by path. An activated venv (CI's: pip's mpich, with its
# own mpicc and mpiexec) would put MPICH's tools first, so it leaves PATH.
if [ -n "${VIRTUAL_ENV:-}" ]; then
    PATH=$(printf '%s' "$PATH" | tr ':' '\n' | grep -vxF "$VIRTUAL_ENV/bin" | paste -sd: -)
    unset VIRTUAL_ENV
fi

# --- Open MPI from the distribution
if ! command -v mpicc >/dev/null || ! command -v ompi_info >/dev/null; then
    command -v apt-get >/dev/null || { say "no Open MPI and no apt-get"; exit 1; }
    say "installing openmpi-bin and libopenmpi-dev with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -q && apt-get install -y -q openmpi-bin libopenmpi-dev; } >&2 \
        || { say "apt-get failed"; exit 1; }
fi
# Open MPI's own directory first: mpicc builds mpi4py, mpiexec launches every case.
OMPI_BIN=$(ompi_info --path bindir 2>/dev/null | awk '{print $NF}')
[ -x "$OMPI_BIN/mpiexec" ] || { say "no mpiexec in Open MPI's bindir '$OMPI_BIN'"; exit 1; }
export PATH="$OMPI_BIN:$PATH"
# CI runs as root, which Open MPI's mpiexec refuses unless told.
if [ "$(id -u)" -eq 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

# --- the second venv (docs/cluster-mpi.md)
PY="$VENV/bin/python"
if ! "$PY" -c 'from mpi4py import MPI; assert MPI.Get_library_version().startswith("Open MPI")' \
        2>/dev/null; then
    built=$(date +%s)
    python3 -m venv "$VENV" || exit 1
    {
        "$PY" -m pip install -q --upgrade pip &&
        # First mpi4py, built against the site's MPI: the project's own requirement
        # (mpi4py>=4) is then met and no binary mpi4py comes.
        env MPICC="$(command -v mpicc)" "$PY" -m pip install -q --no-binary=mpi4py "mpi4py>=4.0,<5" &&
        "$PY" -m pip install -q -e ".[test]" &&
        "$PY" -m pip uninstall -y -q mpich
    } >&2 || { say "the Open MPI venv could not be built"; exit 1; }
    say "venv $VENV built in $(($(date +%s) - built)) s"
elif [ "$("$PY" -I -c 'import hyparflow, os; print(os.path.dirname(os.path.dirname(hyparflow.__file__)))' 2>/dev/null)" != "$ROOT" ]; then
    # A kept venv holds some other checkout's project: this one's is what is tested.
    "$PY" -m pip install -q --no-deps -e "$ROOT" >&2 || { say "could not install $ROOT"; exit 1; }
fi
"$PY" -c 'from mpi4py import MPI; v = MPI.Get_library_version(); print("openmpi-tier: mpi4py on", v.splitlines()[0]); assert v.startswith("Open MPI")' \
    || { say "mpi4py in $VENV is not built against Open MPI"; exit 1; }
if "$PY" -c 'import importlib.metadata as m; m.version("mpich")' 2>/dev/null; then
    say "the mpich wheel is installed in $VENV: the tier would not test the site's MPI"; exit 1
fi

# HYPARFLOW_OMPI_BUILD_ONLY=1: stop here (.ci/run builds the venv beside the main suite).
if [ -n "${HYPARFLOW_OMPI_BUILD_ONLY:-}" ]; then
    say "venv $VENV ready"; exit 0
fi

# --- the cases
declare -a RESULTS=()
FAILED=0
case_() {   # name limit command...: run, time, record
    local name="$1" limit="$2" t0 code
    shift 2
    # HYPARFLOW_OMPI_CASES="cli two-fits": only those (a developer's re-run); CI runs all.
    if [ -n "${HYPARFLOW_OMPI_CASES:-}" ] && [[ " $HYPARFLOW_OMPI_CASES " != *" $name "* ]]; then
        return 0
    fi
    t0=$(date +%s)
    say "case $name: $*"
    if [ "$limit" -gt 0 ]; then timeout --kill-after=30 "$limit" "$@"; else "$@"; fi
    code=$?
    local secs=$(($(date +%s) - t0)) verdict=pass
    [ $code -eq 0 ] || { verdict="FAIL (exit $code)"; FAILED=1; }
    RESULTS+=("$(printf '%-9s %-16s %5d s' "$name" "$verdict" "$secs")")
}
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rs)

case_ cli 600 "${PYTEST[@]}" tests/cluster/test_cli.py -k \
    "info or dry_run or dialect or restart_probes or hosts or exit_code"
# Every file but its three longest cases, whose messages are kinds the others send too
# (the gate's keras.applications models, 20 steps of the encoder-decoder in each order,
# the sweep): ~200 s of 353 (CI's 90 minutes). The main suite runs them under MPICH.
N2="not gate and not encoder_decoder_in_any_order and not sweep_over_ranks"
case_ mpi-n2 1500 env HYPARFLOW_MPI_SELECT="$N2" "${PYTEST[@]}" -s tests/cluster/test_mpi.py \
    -k "test_contract_under_mpiexec and 2"
# At -n 4 only what 4 ranks add (the runner's own selection, AT_FOUR in test_mpi.py).
case_ mpi-n4 1500 "${PYTEST[@]}" -s tests/cluster/test_mpi.py -k "test_contract_under_mpiexec and 4"
case_ faults 900 "${PYTEST[@]}" -s tests/cluster/test_mpi.py -k \
    "failure_on_one_rank or killed_rank or frozen_rank or collective_call_on_some_ranks"

# Hosts: CI's emulated cluster when it is up, else one of this tier's own (own names,
# so as not to meet another's), taken down at the end.
OWN_CLUSTER=0
if [ "$(id -u)" -eq 0 ]; then
    if ! bash scripts/emulated-cluster.sh status >/dev/null 2>&1; then
        export HYPARFLOW_EMU_DIR=/tmp/hyparflow-emu-ompi HYPARFLOW_EMU_PREFIX=ompinode \
            HYPARFLOW_EMU_BRIDGE=hfbr5 HYPARFLOW_EMU_NET=10.213.5
        if bash scripts/emulated-cluster.sh up 2 >/dev/null; then
            OWN_CLUSTER=1
        fi
    fi
    trap '[ $OWN_CLUSTER -eq 1 ] && bash scripts/emulated-cluster.sh down >/dev/null 2>&1' EXIT
    case_ hosts 900 "${PYTEST[@]}" -s tests/hosts/test_hosts_emulated.py -k \
        "stages_across_hosts or replicas_across_hosts"
else
    RESULTS+=("$(printf '%-9s %-16s %5d s' hosts "skipped (not root)" 0)")
fi

two_fits() {
    local k mpiexec
    mpiexec=$("$PY" -c 'from hyparflow.cluster import launch; print(launch.find_mpiexec())')
    for k in $(seq "$RUNS"); do
        timeout 300 "$mpiexec" --oversubscribe --bind-to none -n 2 "$PY" \
            tests/mpi/two_fits_script.py "$ROUNDS" > /tmp/openmpi-tier-two-fits.log 2>&1 || {
            say "two fits: run $k of $RUNS failed:"; tail -n 30 /tmp/openmpi-tier-two-fits.log >&2
            return 1; }
        grep -h "^two fits:" /tmp/openmpi-tier-two-fits.log | sed "s/^/run $k: /"
    done
}
case_ two-fits 0 two_fits   # each run under its own limit

echo "openmpi-tier: $(ompi_info --version 2>/dev/null | head -n 1), mpi4py $("$PY" -c 'import mpi4py; print(mpi4py.__version__)')"
for line in "${RESULTS[@]}"; do echo "openmpi-tier: $line"; done
echo "openmpi-tier: total $(($(date +%s) - START)) s$([ $FAILED -eq 0 ] && echo ', all passed' || echo ', FAILED')"
exit $FAILED
