"""A forward that takes the batch mean (tests/loop/test_coupling.py `centred`) under
mpiexec at R=2: `python coupling_script.py warn` trains and prints each rank's count of
BatchCouplingWarnings (rank 0 warns, once); `... error` makes the warning an error, and
every rank ends with it at set-up."""

import os
import sys
import warnings

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), d)
                for d in ("..", os.path.join("..", "loop"))]

import hyparflow as hf  # noqa: E402

from test_coupling import centred  # noqa: E402

if sys.argv[1] == "error":
    warnings.simplefilter("error", hf.BatchCouplingWarning)
model, x, y = centred()
with warnings.catch_warnings(record=sys.argv[1] == "warn") as caught:
    if sys.argv[1] == "warn":
        warnings.simplefilter("always")
    hf.fit(model, x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, num_replicas=2)
said = [w for w in caught or [] if issubclass(w.category, hf.BatchCouplingWarning)]
print(f"rank {hf.rank()} warned {len(said)}: {said[0].message if said else ''}", flush=True)
