"""Parallel kinds beyond pipeline x data: tensor splits of a layer over T ranks
(tensor), an Embedding's sparse gradients (sparse), the optimizer step shared out over
replicas (zero), replicas that step on their own (replicas). Imports nothing here."""
