"""The planning wing: the cost model (costmodel), predict / search / `hyparflow plan`
(planner), measurements under mpiexec (measure, probes) and the model's profiles
(profile). The training path never imports it (tests/house/test_imports.py)."""
