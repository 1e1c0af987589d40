"""Training from image files: each replica reads and decodes only its own files.

    hyparflow run -n 2 examples/image_files.py      # 2 replicas, each reading half the files
    python examples/image_files.py                  # one process

At start, rank 0 writes scikit-learn's digits as JPEG images into TFRecord files
(`--files`, upscaled to `--size` pixels square). Then `hf.fit` trains a small CNN from
them through a dataset function: `files(ctx)` gives replica `ctx.input_pipeline_id` its
files, decoded and batched by its share of the global batch, as tf.distribute's
`distribute_datasets_from_function` does. No rank decodes another replica's images.
Prints the held-out accuracy and how much of each step waited for data.
"""

import argparse
import os
import tempfile

import hyparflow as hf  # first: quiets TensorFlow and sets threads per rank
import keras
import numpy as np
import tensorflow as tf
from mpi4py import MPI
from sklearn.datasets import load_digits


def write_records(directory, images, labels, files):
    """The images as JPEG-encoded tf.train.Examples, dealt round-robin into `files`
    TFRecord files; their paths."""
    paths = [os.path.join(directory, f"images-{k:03d}-of-{files:03d}.tfrecord")
             for k in range(files)]
    writers = [tf.io.TFRecordWriter(p) for p in paths]
    for i, (image, label) in enumerate(zip(images, labels)):
        jpeg = tf.io.encode_jpeg(image, quality=90).numpy()
        example = tf.train.Example(features=tf.train.Features(feature={
            "jpeg": tf.train.Feature(bytes_list=tf.train.BytesList(value=[jpeg])),
            "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)]))}))
        writers[i % files].write(example.SerializeToString())
    for w in writers:
        w.close()
    return paths


def decoder(size, crop):
    """A record to (an image of `crop` pixels square in [0, 1], its label)."""
    def decode(record):
        parsed = tf.io.parse_single_example(record, {
            "jpeg": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.int64)})
        image = tf.io.decode_jpeg(parsed["jpeg"], channels=3)
        image = tf.image.resize(image, (size, size))
        image = tf.image.resize_with_crop_or_pad(image, crop, crop)
        return image / 255.0, parsed["label"]
    return decode


def pipeline(paths, batch, size, crop):
    """The files read in order, decoded in parallel, batched."""
    return (tf.data.TFRecordDataset(paths)
            .map(decoder(size, crop), num_parallel_calls=tf.data.AUTOTUNE)
            .batch(batch).prefetch(tf.data.AUTOTUNE))


def cnn(crop, classes=10):
    keras.utils.set_random_seed(0)
    inp = keras.Input((crop, crop, 3))
    x = inp
    for filters in (16, 32, 64):
        x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
        x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    model = keras.Model(inp, keras.layers.Dense(classes)(x))
    model.compile(optimizer=keras.optimizers.Adam(2e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def digits(size):
    """scikit-learn's digits as `size` x `size` RGB uint8 images, and their labels."""
    data = load_digits()
    images = tf.image.resize(data.images[..., None] / 16.0 * 255.0, (size, size))
    images = tf.cast(tf.clip_by_value(tf.tile(images, [1, 1, 1, 3]), 0, 255), tf.uint8)
    return images.numpy(), data.target


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--size", type=int, default=40, help="JPEG side, pixels")
    parser.add_argument("--crop", type=int, default=32, help="trained side, pixels")
    parser.add_argument("--batch", type=int, default=64, help="the global batch")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where the files go (default: a new one)")
    args = parser.parse_args()

    images, labels = digits(args.size)
    held = len(images) // 5   # the last fifth, never written: held out
    comm = MPI.COMM_WORLD   # rank 0 writes the files; the others wait for them
    directory = comm.bcast((args.dir or tempfile.mkdtemp(prefix="digits-jpeg-"))
                           if hf.is_main() else None, 0)
    if hf.is_main():
        os.makedirs(directory, exist_ok=True)
        write_records(directory, images[:-held], labels[:-held], args.files)
    comm.Barrier()
    paths = sorted(os.path.join(directory, f) for f in os.listdir(directory))

    def files(ctx):
        mine = paths[ctx.input_pipeline_id::ctx.num_input_pipelines]
        return pipeline(mine, ctx.per_replica_batch_size, args.size, args.crop)

    model = cnn(args.crop)
    history = hf.fit(model, files, batch_size=args.batch, epochs=args.epochs,
                     verbose=2 if hf.is_main() else 0)
    test = (tf.image.resize_with_crop_or_pad(images[-held:] / 255.0, args.crop, args.crop),
            labels[-held:])
    _, accuracy = hf.evaluate(model, *test, batch_size=args.batch, verbose=0)
    if hf.is_main():
        wait = history.data_wait
        print(f"image_files: held-out accuracy {accuracy:.3f}; waiting for data: "
              f"{wait['fraction']:.1%} of each step on rank 0 "
              f"({1e3 * np.median(wait['seconds'][1:]):.1f} ms a step)")


if __name__ == "__main__":
    main()
