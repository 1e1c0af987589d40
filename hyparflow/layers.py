"""Keras layers for training methods that need to see the batch: `ClassBalancedMix`.

Imported as `hyparflow.layers` (`hf.layers.ClassBalancedMix`); plain Keras layers,
usable with `model.fit` as well as with `hyparflow.fit`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import keras
import numpy as np
import numpy.typing as npt

__all__ = ["ClassBalancedMix"]

# Per-class numbers: a list or a numpy array (tensors and masks below are Keras's: Any).
PerClass = Union[Sequence[float], npt.NDArray[Any]]


@keras.saving.register_keras_serializable(package="hyparflow")
class ClassBalancedMix(keras.layers.Layer):
    """Class-balanced feature mixing for imbalanced data: in training, the features of
    a sample of class c become `(1 - rates[c]) * own + rates[c] * partner`, where the
    partner is another sample of the same batch; labels are not changed. Giving the
    frequent classes a rate (and the rare ones none) blurs what the network sees of
    the frequent classes, so it cannot fit them first and leave the rare ones behind.
    At inference (`training=False`) the features pass unchanged.

    The partner of sample i is sample (i - shift) mod n of the batch the layer is
    called on (a roll along the batch, as Mixup implementations pair a batch with
    itself reversed or rolled): deterministic for a given batch, so a run repeats
    exactly; shuffle the data (`fit`'s default) so partners change from epoch to
    epoch.

    **Which batch.** Like BatchNormalization's statistics, the partner comes from the
    batch the layer sees: under `hyparflow.fit` that is one microbatch (B / (R x M)
    samples), so with one replica and one microbatch (M = R = 1) the layer mixes
    within the whole batch exactly as under `model.fit`, and with more it mixes
    within each microbatch, training as `model.fit(batch_size=B // (R*M))` with the
    optimizer's `gradient_accumulation_steps=R*M` does (docs/models.md).

    Call it on `[features, labels]`: labels as class ids (any shape whose elements
    are one per sample, e.g. `(batch,)` or `(batch, 1)`) or one-hot / probabilities
    `(batch, classes)` (the largest is the class). The model then takes the labels as
    an input too (pass them in `x` as well as `y`); at inference any labels do
    (zeros), since they are not read.

    Args:
        rates: one mixing rate per class, in [0, 1); class ids index it.
        shift: how far along the batch the partner is (>= 1).
    """

    def __init__(self, rates: PerClass, shift: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        values = rates.tolist() if hasattr(rates, "tolist") else rates
        rates = [float(r) for r in values]
        if not rates:
            raise ValueError("ClassBalancedMix: `rates` is empty; give one mixing rate per "
                             "class (0 for a class that is not mixed).")
        bad = [(c, r) for c, r in enumerate(rates) if not 0.0 <= r < 1.0]
        if bad:
            raise ValueError(f"ClassBalancedMix: every rate must be in [0, 1) (the share of "
                             f"the partner's features). Received: class {bad[0][0]} rate "
                             f"{bad[0][1]!r}.")
        if isinstance(shift, bool) or not isinstance(shift, (int, np.integer)) or shift < 1:
            raise ValueError(f"ClassBalancedMix: `shift` must be an integer >= 1. "
                             f"Received: shift={shift!r}")
        self.rates = rates
        self.shift = int(shift)

    @classmethod
    def from_counts(cls, counts: PerClass, strength: float = 0.5, **kwargs: Any) -> ClassBalancedMix:
        """Rates from the number of training samples of each class: `strength x (1 -
        rarest / count)`, so the rarest class is not mixed and the most frequent
        ones most (up to `strength`)."""
        array = np.asarray(counts, dtype=np.float64)
        if array.ndim != 1 or not len(array) or np.any(array <= 0):
            raise ValueError(f"ClassBalancedMix.from_counts: `counts` must be positive "
                             f"sample counts, one per class. Received: {array.tolist()}")
        if not 0.0 <= strength < 1.0:
            raise ValueError(f"ClassBalancedMix.from_counts: `strength` must be in [0, 1). "
                             f"Received: strength={strength!r}")
        return cls((strength * (1.0 - array.min() / array)).tolist(), **kwargs)

    def _class_ids(self, labels: Any) -> Any:
        labels = keras.ops.convert_to_tensor(labels)
        if len(labels.shape) > 1 and labels.shape[-1] not in (None, 1):
            return keras.ops.argmax(labels, axis=-1)  # one-hot or probabilities
        return keras.ops.reshape(keras.ops.cast(labels, "int32"), (-1,))

    def call(self, inputs: Sequence[Any], training: Optional[bool] = None) -> Any:
        features, labels = inputs
        if not training:
            return features
        ids = self._class_ids(labels)
        rate = keras.ops.take(keras.ops.convert_to_tensor(self.rates, features.dtype), ids)
        rate = keras.ops.reshape(rate, (-1,) + (1,) * (len(features.shape) - 1))
        partner = keras.ops.roll(features, self.shift, axis=0)
        return (1.0 - rate) * features + rate * partner

    def compute_output_shape(self, input_shape: Sequence[Any]) -> Any:
        return input_shape[0]

    def compute_mask(self, inputs: Any, mask: Optional[Sequence[Any]] = None) -> Any:
        return None if mask is None else mask[0]

    def get_config(self) -> dict[str, Any]:
        return dict(super().get_config(), rates=list(self.rates), shift=self.shift)
