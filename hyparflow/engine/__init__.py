"""The engine: one rank's set-up (runtime), its schedule run (executor), a stage's
compiled forward and backward (stage), what crosses a stage (boundary), communicators
(comm, local, calls), gradient buckets (overlap), Dense kernels, checkpoints and the
partition of the layer graph. Its modules are imported by name; this file imports
nothing (a process that does not train must not start TensorFlow through it)."""
