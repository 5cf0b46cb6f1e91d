"""Bad input and faults through the TensorFlow doors: clear errors on every rank, never a hang."""
import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

import horovod_quant.tensorflow as hqtf

from conftest import codec_params, linear_loss, rank_gradients, same_on_every_rank

EVERYTHING = hqtf.LayerPolicy.everything()


def _tape_fn(comp, vs, use_function):
    def step_fn(grads):
        with tf.GradientTape() as tape:
            loss = linear_loss(vs, grads)
        return hvd.DistributedGradientTape(tape, compression=comp).gradient(loss, vs)
    return tf.function(step_fn) if use_function else step_fn


@pytest.mark.parametrize("use_function", [False, True])
def test_config_mismatch_raises_on_every_rank(use_function):
    shapes = [(8, 8)]
    vs = [tf.Variable(tf.zeros(s)) for s in shapes]
    bits = 4 if hvd.rank() == 0 else 8
    comp = hqtf.Compression.qsgd(bits=bits, seed=1, policy=EVERYTHING)
    fn = _tape_fn(comp, vs, use_function)
    if hvd.size() == 1:
        return
    with pytest.raises(ValueError, match="differs between ranks"):
        fn(rank_gradients(shapes, 0, hvd.rank()))
    assert comp.calls == 0


def test_world_too_large_for_width_fails_at_construction():
    with pytest.raises(ValueError, match="bits"):
        hqtf.Compression.global_qsgd(bits=2, levels="linear", world_size=64)
    with pytest.raises(ValueError, match="bits"):
        hqtf.Compression.global_qsgd(bits=3, levels="exponential", world_size=4096)


def test_bad_parameters_fail_at_construction():
    with pytest.raises(AttributeError, match="qsgd"):
        _ = hqtf.Compression.qsdg
    with pytest.raises(ValueError, match="gather"):
        hqtf.Compression.qsgd(gather="ring")
    with pytest.raises(ValueError, match="bits"):
        hqtf.Compression.qsgd(bits=1)


@pytest.mark.parametrize("name,params", [("qsgd", {}), ("natural", {}), ("dithered", {}),
                                         ("global_qsgd", {}),
                                         ("global_qsgd", {"levels": "linear"})])
def test_nonfinite_zero_and_tiny_sizes(name, params):
    shapes = [(0,), (1,), (4, 300), (3, 3)]
    vs = [tf.Variable(tf.zeros(s)) for s in shapes]
    comp = getattr(hqtf.Compression, name)(policy=EVERYTHING, **params, **codec_params(name))
    fn = _tape_fn(comp, vs, use_function=True)

    grads = rank_gradients(shapes, 0, hvd.rank())
    # overflow on one rank only: the first rank in one tensor, the last rank in another (an
    # allreduce(max) of the global norm keeps a NaN only from the first operand)
    grads[2][1, 7] = np.inf if hvd.rank() == 0 else 1.0
    grads[3][2, 0] = np.nan if hvd.rank() == hvd.size() - 1 else 1.0
    got = [g.numpy() for g in fn(grads)]
    assert got[0].shape == (0,) and got[1].shape == (1,)
    if hvd.size() > 1:
        for j in (2, 3):
            assert not np.isfinite(got[j]).all(), "overflow must stay visible on every rank"
            assert same_on_every_rank(np.isfinite(got[j]).astype(np.float32))
    got = [g.numpy() for g in fn([np.zeros(s, np.float32) for s in shapes])]
    for g in got:
        assert np.array_equal(g, np.zeros_like(g)), "zero gradients decode to zeros"
    got = [g.numpy() for g in fn(rank_gradients(shapes, 1, hvd.rank()))]
    assert all(np.isfinite(g).all() for g in got)


def test_half_precision_gradients_keep_their_dtype():
    shapes = [(32, 40)]
    v = tf.Variable(tf.zeros(shapes[0], tf.float16))
    comp = hqtf.Compression.qsgd(bits=8, policy=EVERYTHING)

    @tf.function
    def step_fn(g):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * g)
        return hvd.DistributedGradientTape(tape, compression=comp).gradient(loss, [v])[0]

    g = rank_gradients(shapes, 0, hvd.rank())[0]
    out = step_fn(tf.constant(g.astype(np.float16)))
    assert out.dtype == tf.float16 and out.shape == shapes[0]
    mean = np.mean([rank_gradients(shapes, 0, r)[0] for r in range(hvd.size())], axis=0)
    assert np.abs(out.numpy().astype(np.float32) - mean).max() < 0.2 * np.abs(mean).max()
