"""`fit`'s options below the layout, as one record passed down to the trainer: the
Keras loop's (as `model.fit` takes them), checkpointing, and balancing's speeds and
memory limit. `fit`'s docstring says what each does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

__all__ = ["FitOptions"]


@dataclass(frozen=True)
class FitOptions:
    batch_size: int = 32
    epochs: int = 1
    shuffle: bool = True
    seed: Optional[int] = None
    verbose: Union[int, str] = "auto"
    callbacks: Optional[Sequence[Any]] = None
    sample_weight: Any = None
    class_weight: Any = None
    run_eagerly: Optional[bool] = None
    recompute: bool = False
    trace: Optional[str] = None
    validation_data: Any = None
    validation_split: float = 0.0
    validation_freq: Any = 1
    initial_epoch: int = 0
    steps_per_epoch: Optional[int] = None
    validation_batch_size: Optional[int] = None
    validation_steps: Optional[int] = None
    # Checkpointing.
    checkpoint_dir: Optional[str] = None
    checkpoint_every: Any = "epoch"
    keep: int = 3
    resume: bool = False
    check_finite: bool = True
    # Balancing (with the layout's `balance`) and replicas.
    speeds: Any = None
    memory_limit: Any = None
    replica_sync: Any = None
    # Sharded embedding tables (kinds/tables).
    embedding_sharding: Any = None
    # Checked against the threads TensorFlow started with (engine/node.py).
    threads_per_rank: Optional[int] = None
    communication_dtype: Any = None
    # A tf.data service that decodes the replicas' datasets (readers/service.py).
    data_service: Optional[str] = None
    data_service_mode: Optional[str] = None
