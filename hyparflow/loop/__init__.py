"""The Keras loop: fit / evaluate / predict (api), epochs, callbacks and history
(trainer), forward-only passes (inference), data sources, progress, global metrics and
the balance modes' costs. Its modules are imported by name; this file imports nothing."""
