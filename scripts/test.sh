#!/usr/bin/env bash
# The whole suite (README: Test; .ci/run), in two phases:
#   1. every in-process test, on $HYPARFLOW_TEST_WORKERS pytest-xdist workers (default 2):
#      such a test keeps about one core busy (tracing is Python), so two share two cores;
#   2. the tests that start ranks as processes (marker `mpiexec`: mpiexec, srun, sbatch,
#      emulated hosts), one at a time: their ranks take every core, and their failure
#      detection runs on the clock, which a neighbour's load would skew.
# Arguments go to both phases (a path, -k, -x ...). Exit: non-zero when either failed.
set -uo pipefail
cd "$(dirname "$0")/.."
WORKERS="${HYPARFLOW_TEST_WORKERS:-2}"

status=0
phase() {   # pytest's 5 is "nothing collected": a path may hold only one phase's tests
    python -m pytest --durations=25 "$@"
    local code=$?
    [ $code -eq 0 ] || [ $code -eq 5 ] || status=1
}
if [ "$WORKERS" -gt 1 ]; then
    phase -q -n "$WORKERS" -m "not mpiexec" "$@"
else
    phase -q -m "not mpiexec" "$@"
fi
phase -q -m mpiexec "$@"
exit $status
