"""examples/masked_segmentation.py's training (a U-Net whose loss counts only the pixels
inside a mask, as a mean over the whole batch's) is model.fit's at S=2, M=4, though its
microbatches hold very different numbers of labelled pixels."""

import os
import sys

import keras
import numpy as np
import pytest

from conftest import max_diff, train_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))
import masked_segmentation as example  # noqa: E402


def build():
    keras.utils.set_random_seed(0)
    model = example.build_unet()
    model.compile(optimizer=keras.optimizers.Adam(2e-3),
                  loss=keras.losses.BinaryCrossentropy(reduction="mean_with_sample_weight"))
    return model


@pytest.mark.timeout(300)
def test_masked_unet_trains_as_model_fit():
    images, masks, trees = example.scenes(16, seed=0)
    masks[:3] = 0  # three tiles nobody surveyed: the first microbatch holds one's labels
    counts = masks.reshape(4, -1).sum(axis=1)  # labelled pixels of each microbatch of 4
    assert counts.max() > 4 * counts.min()
    x, sw = {"image": images, "mask": masks}, masks[..., 0]
    reference = build()
    start = reference.get_weights()
    reference.fit(x, trees, sample_weight=sw, batch_size=16, epochs=2, shuffle=False, verbose=0)
    results = train_ranks(build, x, trees, num_stages=2, num_replicas=1, num_microbatches=4,
                          weights=start, batch_size=16, epochs=2, shuffle=False,
                          sample_weight=sw)
    for weights, _ in results:
        assert max_diff(weights, reference.get_weights()) <= 1e-4
