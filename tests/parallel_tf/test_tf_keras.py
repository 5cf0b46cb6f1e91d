"""A short Keras ``model.fit`` (2 ranks, digits MLP) through horovod.tensorflow.keras's
DistributedOptimizer converges like the uncompressed run for 8-bit codecs, and the ranks end
with identical weights."""
import horovod.tensorflow.keras as hvd
import numpy as np
import pytest

import horovod_quant.tensorflow as hqtf

from conftest import codec_params, same_on_every_rank

# training quality: the exchanges a fit runs are checked bit for bit under every
# controller (test_tf_exact.py)
pytestmark = pytest.mark.controller_independent

EIGHT_BIT = [("qsgd", {"bits": 8}), ("nuqsgd", {"bits": 8}), ("natural", {"bits": 8}),
             ("natural_dithering", {"bits": 8}), ("global_qsgd", {"bits": 8}),
             ("dithered", {"bits": 8})]
EPOCHS, BATCH = 2, 32  # 2 epochs of 28 steps per rank


def _data():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype(np.float32)[:1792], y.astype(np.int64)[:1792]
    return x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()], x, y


def _train(compression):
    import tf_keras as keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(128, activation="relu", input_shape=(64,)),
                              keras.layers.Dense(10)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                   compression=compression)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y, x_all, y_all = _data()
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    loss = float(model.evaluate(x_all, y_all, batch_size=512, verbose=0))
    weights = np.concatenate([w.reshape(-1) for w in model.get_weights()])
    assert same_on_every_rank(weights), "ranks must hold identical weights"
    return loss


@pytest.fixture(scope="module")
def baseline_loss():
    return _train(hvd.Compression.none)


@pytest.mark.parametrize("name,params", EIGHT_BIT)
def test_eight_bit_fit_matches_uncompressed(name, params, baseline_loss):
    comp = getattr(hqtf.Compression, name)(**params, **codec_params(name))
    loss = _train(comp)
    print(f"[rank {hvd.rank()}] {name}: loss {loss:.4f}, uncompressed {baseline_loss:.4f}")
    # stated tolerance: within 0.05 nats (or 15 %) of the uncompressed run after 56 steps
    assert loss <= max(baseline_loss + 0.05, baseline_loss * 1.15), (name, loss, baseline_loss)
    if hvd.size() > 1:
        # both kernels (64x128, 128x10) compressed, both biases through Horovod's allreduce
        assert comp.calls == 2 * EPOCHS * 28
        assert comp.stats.compression_ratio > 3.0
