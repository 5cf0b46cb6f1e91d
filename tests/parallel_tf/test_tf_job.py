"""A whole TensorFlow training job through the compressor: resumed from a tf.train.Checkpoint
(the compressor's call counter and codec states beside the variables and the optimizer) it
continues bit for bit on every rank; float16 and bfloat16 gradients keep their dtype; the job
loads no torch."""
import sys

import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

import horovod_quant as hq
import horovod_quant.tensorflow as hqtf

from conftest import codec_params, linear_loss, rank_gradients, reference, same_on_every_rank

# checkpoints and dtypes: the exchanges they run are checked bit for bit under every
# controller (test_tf_exact.py)
pytestmark = pytest.mark.controller_independent

SHAPES = [(30, 40), (20, 10)]
EVERYTHING = hqtf.LayerPolicy.everything()


def _correlated(step, rank):
    """A common part plus a little of each rank's own: NDQSG's coarse ratio adapts to it."""
    common, own = rank_gradients(SHAPES, step, 0), rank_gradients(SHAPES, step, rank + 1)
    return [c * np.float32(0.1) + np.float32(0.001) * o for c, o in zip(common, own)]


class _Job:
    """Variables, an SGD optimizer with momentum and a compressor; ``step(t)`` trains one step
    (a tf.function, DistributedGradientTape) on the gradients of step t."""

    def __init__(self, name, params):
        self.vs = [tf.Variable(tf.zeros(s)) for s in SHAPES]
        self.opt = tf.keras.optimizers.SGD(0.1, momentum=0.9)
        self.comp = getattr(hqtf.Compression, name)(seed=4, policy=EVERYTHING, **params,
                                                    **codec_params(name))

        @tf.function
        def train(grads):
            with tf.GradientTape() as tape:
                loss = linear_loss(self.vs, grads)
            tape = hvd.DistributedGradientTape(tape, compression=self.comp)
            self.opt.apply_gradients(zip(tape.gradient(loss, self.vs), self.vs))

        self._train = train

    def step(self, t):
        self._train([tf.constant(g) for g in _correlated(t, hvd.rank())])

    def checkpoint(self):
        return tf.train.Checkpoint(vs=self.vs, optimizer=self.opt, hq=self.comp.checkpointable)

    def values(self):
        return np.concatenate([v.numpy().reshape(-1) for v in self.vs])


@pytest.mark.parametrize("name,params", [("qsgd", {}), ("nested_dithered", {"bits": 6})])
def test_resumed_job_continues_bit_for_bit(name, params, tmp_path_factory):
    n, half = 6, 3
    straight = _Job(name, params)
    for t in range(n):
        straight.step(t)
    job = _Job(name, params)
    for t in range(half):
        job.step(t)
    if name == "nested_dithered" and hvd.size() > 1:
        assert job.comp.codec_states.state_dict()  # it has adapted
    path = job.checkpoint().write(str(tmp_path_factory.mktemp(f"ckpt{hvd.rank()}") / "job"))
    resumed = _Job(name, params)
    resumed.opt.build(resumed.vs)  # slots exist before the restore, as after a first step
    resumed.checkpoint().read(path).assert_existing_objects_matched()
    assert resumed.comp.calls == job.comp.calls
    assert resumed.comp.codec_states.state_dict() == job.comp.codec_states.state_dict()
    for t in range(half, n):
        resumed.step(t)
    np.testing.assert_array_equal(resumed.values(), straight.values())
    assert same_on_every_rank(straight.values())


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_low_precision_gradients_are_encoded_from_their_dtype(dtype):
    """float16 / bfloat16 variables: their gradients (as float32 values) go through the codec
    and the mean comes back in their dtype, on every rank."""
    comp = hqtf.Compression.qsgd(seed=6, policy=EVERYTHING)
    vs = [tf.Variable(tf.zeros(s, dtype)) for s in SHAPES]

    @tf.function
    def grads_of(gs):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(tf.cast(v, tf.float32) * g) for v, g in zip(vs, gs)])
        return hvd.DistributedGradientTape(tape, compression=comp).gradient(loss, vs)

    k0 = comp.calls
    got = grads_of([tf.constant(g) for g in rank_gradients(SHAPES, 0, hvd.rank())])
    for j, g in enumerate(got):
        assert g.dtype == dtype
        per_rank = [tf.cast(tf.cast(rank_gradients(SHAPES, 0, r)[j], dtype), tf.float32).numpy()
                    for r in range(hvd.size())]
        want = per_rank[0]  # one rank: Horovod reduces nothing
        if hvd.size() > 1:
            want = reference(hq.get_codec("qsgd"), per_rank, 6, k0 + j)
        np.testing.assert_array_equal(g.numpy(), tf.cast(want.reshape(SHAPES[j]), dtype).numpy())
        assert same_on_every_rank(tf.cast(g, tf.float32).numpy())


def test_the_job_loads_no_torch():
    """The compressor agrees on the job's end in the store of horovod_quant.store, so a
    TensorFlow job never imports torch (seconds and memory on every rank)."""
    job = _Job("qsgd", {})
    job.step(0)
    assert job.comp.calls > 0 and "torch" not in sys.modules
