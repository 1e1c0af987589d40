"""The cluster: `hyparflow run` (launch), Slurm scripts (slurm), --hosts placement
(hosts), a rank's heartbeat (heartbeat) and --restarts (restart). Imports nothing here:
the command loads these without TensorFlow."""
