"""Data-parallel Keras training of a small MLP on scikit-learn's digits with horovod_quant.

    TF_USE_LEGACY_KERAS=1 horovodrun -np 2 python examples/tensorflow2_keras.py
    TF_USE_LEGACY_KERAS=1 horovodrun -np 2 python examples/tensorflow2_keras.py --codec natural:8
    TF_USE_LEGACY_KERAS=1 horovodrun -np 2 python examples/tensorflow2_keras.py --device cuda

Horovod's Keras optimizer wrapper needs Keras 2 (the tf-keras package, selected by
``TF_USE_LEGACY_KERAS=1``; see docs/tensorflow.md). The lines that integrate horovod_quant are
marked ``# horovod_quant:``; everything else is a plain Horovod Keras script. ``--codec none``
trains without compression for comparison. ``--device cuda`` gives each rank the GPU of its local
rank (a TensorFlow with CUDA); ``cpu`` hides the GPUs. Needs Horovod built with TensorFlow,
tf-keras and scikit-learn.
"""
import argparse
import logging
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras = tf-keras (Keras 2)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import horovod_quant.tensorflow as hq  # horovod_quant: the TensorFlow door


def build_compression(spec: str):
    """``name`` or ``name:bits`` -> a Horovod Compressor (``none`` = Horovod's own)."""
    name, _, bits = spec.partition(":")
    if name == "none":
        return hvd.Compression.none
    params = {"bits": int(bits)} if bits else {}
    return getattr(hq.Compression, name)(**params)  # horovod_quant: pick a codec


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--codec", default="qsgd:8", help="codec spec, e.g. qsgd:4, global_qsgd:8")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: each rank on the GPU of its local rank; cpu: GPUs hidden")
    args = ap.parse_args()

    hvd.init()
    gpus = tf.config.list_physical_devices("GPU")
    if args.device == "cuda" and not gpus:
        ap.error("--device cuda: this TensorFlow sees no GPU")
    tf.config.set_visible_devices(
        [gpus[hvd.local_rank() % len(gpus)]] if args.device == "cuda" else [], "GPU")
    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras = tf.keras
    if not keras.__name__.startswith("tf_keras"):
        raise SystemExit("Horovod's Keras wrapper needs tf-keras: run with TF_USE_LEGACY_KERAS=1")
    keras.utils.set_random_seed(0)

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype(np.float32), y.astype(np.int64)
    n_test = 297
    x_test, y_test, x, y = x[:n_test], y[:n_test], x[n_test:], y[n_test:]
    # one shard per rank, cut to whole batches so that every rank runs the same steps
    per_rank = len(x) // hvd.size() // args.batch * args.batch
    x, y = x[hvd.rank()::hvd.size()][:per_rank], y[hvd.rank()::hvd.size()][:per_rank]

    model = keras.Sequential([keras.layers.Dense(256, activation="relu", input_shape=(64,)),
                              keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(10)])
    compression = build_compression(args.codec)
    opt = keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, compression=compression)  # horovod_quant: compression=
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    if isinstance(compression, hq.QuantizedCompressor):
        # horovod_quant: a logging line of bytes sent/saved and codec time per epoch (rank 0)
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        callbacks.append(hq.StatsCallback(compression, every=0))
    model.fit(x, y, batch_size=args.batch, epochs=args.epochs, shuffle=True,
              callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0)
    loss, acc = model.evaluate(x_test, y_test, verbose=0)
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, codec {args.codec}: test loss {loss:.4f}, "
              f"test accuracy {acc:.4f}")


if __name__ == "__main__":
    main()
