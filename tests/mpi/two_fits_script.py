"""Two hf.fit calls in one process, each against plain model.fit (Adam), then an
hf.evaluate: `mpiexec -n N python two_fits_script.py`, started by tests/test_mpi.py and by
scripts/openmpi-tier.sh (20 times in a row).

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

x, y = models.mlp_data(64)
diffs = []
# A pipeline of every rank, then replicas of 2-stage pipelines (or one when n = 2).
for stages in (hf.size(), 2 if hf.size() > 2 else 1):
    reference = models.mlp("adam")
    start = reference.get_weights()
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model = models.mlp("adam")
    model.set_weights(start)
    hf.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, num_stages=stages,
           num_microbatches=2)
    diffs.append(max(float(np.max(np.abs(a - b)))
                     for a, b in zip(model.get_weights(), reference.get_weights())))
loss = float(np.atleast_1d(hf.evaluate(model, x, y, batch_size=16, verbose=0))[0])
expected = float(np.atleast_1d(reference.evaluate(x, y, batch_size=16, verbose=0))[0])
if hf.is_main():
    print(f"two fits: {hf.size()} ranks, max weight differences "
          f"{', '.join(f'{d:.2e}' for d in diffs)}; evaluate {loss:.6f} vs {expected:.6f}",
          flush=True)
assert max(diffs) < 1e-5, diffs
assert abs(loss - expected) < 1e-4, (loss, expected)
keras.backend.clear_session()
