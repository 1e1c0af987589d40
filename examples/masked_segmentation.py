"""Segmentation from labels known only inside a region: a small U-Net, hybrid-parallel.

    hyparflow run -n 2 --stages 2 --microbatches 4 examples/masked_segmentation.py
    python examples/masked_segmentation.py --stages 1 --microbatches 1   # one process

Synthetic aerial-like images are made at run time: textured ground, a network of roads,
and trees everywhere. As in a street-tree survey, the trees are labelled only along the
roads (a corridor a few pixels wide): outside it nobody looked, so a pixel there is not
"no tree" but unknown. The corridor mask is an input of the model (the network knows
where labels exist) and also coats its output (the prediction is multiplied by it), and
the loss counts only the pixels inside it. After training, the model is asked about every
pixel (mask of ones) and scored against the full synthetic truth, inside the corridor and
outside it, where it never saw a label.

The loss is the binary cross-entropy with the mask as a per-pixel `sample_weight` map and
`reduction="mean_with_sample_weight"`: the mean over the pixels inside the mask of the
whole batch. The microbatches hold very different numbers of such pixels, so each one's
sum is divided by the batch's count, agreed between the ranks before the backward
(docs/models.md, "Losses over the whole batch"): training ends with model.fit's weights.
"""

import argparse
import os

import hyparflow as hf  # first: quiets TensorFlow and sets threads per rank
import keras
import numpy as np

SIZE = 32


def scenes(n, seed):
    """n images (SIZE x SIZE x 3), their road-corridor masks and their tree labels."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE]
    images = np.empty((n, SIZE, SIZE, 3), np.float32)
    masks = np.empty((n, SIZE, SIZE, 1), np.float32)
    trees = np.empty((n, SIZE, SIZE, 1), np.float32)
    for k in range(n):
        # Ground: a base colour, slow undulations, grain.
        ground = rng.uniform([0.35, 0.35, 0.2], [0.55, 0.5, 0.3])
        wave = 0.06 * np.sin(xx / rng.uniform(3, 8) + rng.uniform(0, 6)) * np.cos(
            yy / rng.uniform(3, 8) + rng.uniform(0, 6))
        image = ground + wave[..., None] + rng.normal(0, 0.03, (SIZE, SIZE, 3))
        # Roads: one each way, sometimes two, 2 pixels wide; the surveyed corridor
        # reaches 2 pixels out on each side.
        road = np.zeros((SIZE, SIZE), bool)
        corridor = np.zeros((SIZE, SIZE), bool)
        for axis in (0, 1):
            count = 1 + int(rng.random() < 0.3)
            for at in rng.choice(np.arange(3, SIZE - 4), count, replace=False):
                line = (yy if axis == 0 else xx)
                road |= (line >= at) & (line < at + 2)
                corridor |= (line >= at - 2) & (line < at + 4)
        # Trees: round crowns, denser along the roads, never on them.
        label = np.zeros((SIZE, SIZE), bool)
        for _ in range(rng.integers(8, 16)):
            near = rng.random() < 0.6
            for _ in range(20):  # a place off the road (near it, or anywhere)
                cy, cx = rng.uniform(1, SIZE - 1, 2)
                if not road[int(cy), int(cx)] and corridor[int(cy), int(cx)] == near:
                    break
            crown = (yy - cy) ** 2 + (xx - cx) ** 2 <= rng.uniform(1.5, 2.6) ** 2
            label |= crown & ~road
        image[road] = rng.uniform(0.55, 0.65) + rng.normal(0, 0.02, (road.sum(), 3))
        image[label] = np.array([0.08, 0.3, 0.08]) + rng.normal(0, 0.03, (label.sum(), 3))
        images[k] = np.clip(image, 0, 1)
        masks[k, ..., 0] = corridor
        trees[k, ..., 0] = label
    return images, masks, trees


def build_unet():
    """A two-level U-Net; the mask comes in beside the image and coats the output."""
    image = keras.Input((SIZE, SIZE, 3), name="image")
    mask = keras.Input((SIZE, SIZE, 1), name="mask")

    def twice(x, filters):
        x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
        return keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)

    c1 = twice(keras.layers.Concatenate()([image, mask]), 16)
    c2 = twice(keras.layers.MaxPooling2D()(c1), 32)
    bottom = twice(keras.layers.MaxPooling2D()(c2), 64)
    u2 = twice(keras.layers.Concatenate()([keras.layers.UpSampling2D()(bottom), c2]), 32)
    u1 = twice(keras.layers.Concatenate()([keras.layers.UpSampling2D()(u2), c1]), 16)
    tree = keras.layers.Conv2D(1, 1, activation="sigmoid", name="tree")(u1)
    coated = keras.layers.Multiply(name="coat")([tree, mask])
    return keras.Model({"image": image, "mask": mask}, coated, name="masked_unet")


def scores(model, images, masks, trees):
    """Pixel accuracy and tree IoU inside and outside the corridor, the model asked about
    every pixel (a mask of ones: no coat)."""
    predicted = model.predict({"image": images, "mask": np.ones_like(masks)}, verbose=0,
                              batch_size=128) > 0.5
    truth = trees > 0.5
    out = {}
    for where, region in (("inside", masks > 0.5), ("outside", masks < 0.5)):
        p, t = predicted[region], truth[region]
        union = np.sum(p | t)
        out[where] = (float(np.mean(p == t)), float(np.sum(p & t) / union) if union else 1.0)
    return out


def launched(name, default):
    """The count `hyparflow run` was given (--stages: HYPARFLOW_NUM_STAGES), else `default`."""
    return int(os.environ.get(f"HYPARFLOW_NUM_{name}") or default)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=None,
                        help="pipeline stages (default: the launcher's --stages, else 2)")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="microbatches (default: the launcher's --microbatches, else 4)")
    parser.add_argument("--samples", type=int, default=768, help="training images")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    stages = args.stages or launched("STAGES", 2)
    microbatches = args.microbatches or launched("MICROBATCHES", 4)

    images, masks, trees = scenes(args.samples, seed=0)  # the same on every rank
    test = scenes(256, seed=1)
    keras.utils.set_random_seed(0)
    model = build_unet()
    # Only the pixels inside the mask count, and the mean is over them (not all pixels).
    model.compile(optimizer=keras.optimizers.Adam(2e-3),
                  loss=keras.losses.BinaryCrossentropy(reduction="mean_with_sample_weight"))
    history = hf.fit(model, {"image": images, "mask": masks}, trees,
                     sample_weight=masks[..., 0], batch_size=args.batch_size,
                     epochs=args.epochs, num_stages=stages, num_microbatches=microbatches,
                     seed=0, verbose=2 if hf.is_main() else 0)

    if hf.is_main():
        result = scores(model, *test)
        share = float(np.mean(test[1]))
        print(f"labels known on {share:.0%} of the pixels (the road corridors); "
              f"{stages} stages x {hf.size() // stages} replicas x {microbatches} microbatches")
        for where, (accuracy, iou) in result.items():
            print(f"  {where:<7} the corridor: pixel accuracy {accuracy:.3f}, tree IoU {iou:.3f}")
        print(f"masked_segmentation: final loss {history.history['loss'][-1]:.4f}; accuracy "
              f"{result['inside'][0]:.3f} inside the mask, {result['outside'][0]:.3f} outside")


if __name__ == "__main__":
    main()
