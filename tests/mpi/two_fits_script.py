"""Two hf.fit calls in one process, each against plain model.fit (Adam), then an
hf.evaluate, ROUNDS times (default 1): `mpiexec -n N python two_fits_script.py [ROUNDS]`,
started by tests/cluster/test_mpi.py and by scripts/openmpi-tier.sh (20 rounds in all).

Each call starts and stops a heartbeat and frees its communicators; the next call's must
not meet anything the last one left (Open MPI hung in the second call's heartbeat `Idup`
when a goodbye was left on a freed communicator, then corrupted its heap at exit).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hyparflow as hf  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import models  # noqa: E402

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 1   # of the two fits and the evaluate
x, y = models.mlp_data(64)
# A pipeline of every rank, then replicas of 2-stage pipelines (or one when n = 2).
LAYOUTS = (hf.size(), 2 if hf.size() > 2 else 1)
references, starts = [], []
for stages in LAYOUTS:
    reference = models.mlp("adam")
    starts.append(reference.get_weights())
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    references.append(reference.get_weights())
expected = float(np.atleast_1d(reference.evaluate(x, y, batch_size=16, verbose=0))[0])
for round_ in range(ROUNDS):
    diffs = []
    for stages, start, weights in zip(LAYOUTS, starts, references):
        model = models.mlp("adam")
        model.set_weights(start)
        hf.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
               num_stages=stages, num_microbatches=2)
        diffs.append(max(float(np.max(np.abs(a - b)))
                         for a, b in zip(model.get_weights(), weights)))
    loss = float(np.atleast_1d(hf.evaluate(model, x, y, batch_size=16, verbose=0))[0])
    if hf.is_main():
        print(f"two fits: {hf.size()} ranks, round {round_ + 1}/{ROUNDS}, max weight "
              f"differences {', '.join(f'{d:.2e}' for d in diffs)}; evaluate {loss:.6f} vs "
              f"{expected:.6f}", flush=True)
    assert max(diffs) < 1e-5, diffs
    assert abs(loss - expected) < 1e-4, (loss, expected)
keras.backend.clear_session()
