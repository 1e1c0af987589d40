"""Keras's own data adapters and epoch iterator (keras.src.trainers): what
`model.fit` reads a tf.data.Dataset, a keras.utils.PyDataset, a generator (and a
torch DataLoader or grain dataset) through, so that epochs, `steps_per_epoch`,
workers and `on_epoch_end` behave as they do there."""

from typing import Any

__all__ = ["epoch_iterator", "is_stream", "numpy_batches"]


def is_stream(x: Any) -> bool:
    """Data that Keras reads batch by batch (not arrays it slices)."""
    from keras.src.trainers.data_adapters import array_data_adapter

    return x is not None and not isinstance(x, (dict, list, tuple)) and \
        not array_data_adapter.can_convert_arrays((x,)) and not hasattr(x, "__array__")


def epoch_iterator(x: Any, *, steps_per_epoch: Any = None, class_weight: Any = None,
                   shuffle: bool = False) -> Any:
    """Keras's EpochIterator over `x`, numpy batches, as `model.fit` builds it."""
    from keras.src.trainers.epoch_iterator import EpochIterator

    return EpochIterator(x, steps_per_epoch=steps_per_epoch, class_weight=class_weight,
                         shuffle=shuffle)


def numpy_batches(dataset: Any, class_weight: Any = None) -> Any:
    """One pass over a tf.data.Dataset as Keras's adapter gives it: numpy batches, the
    class weights turned into sample weights."""
    from keras.src.trainers.data_adapters.tf_dataset_adapter import TFDatasetAdapter

    return iter(TFDatasetAdapter(dataset, class_weight=class_weight).get_numpy_iterator())
