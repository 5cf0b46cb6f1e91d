"""The Horovod TensorFlow door's part of tests/doors: the same codec, seed and gradients
through ``hvd.DistributedGradientTape(compression=hq.tensorflow.Compression.<codec>(...))``,
written for tests/doors/test_doors_agree.py. Runs in 2-rank worlds only (the comparison's), on
every rank alike."""
import sys
from pathlib import Path

import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

import horovod_quant.tensorflow as hqtf
from horovod_quant.core.rng import payload_seed

from conftest import linear_loss, same_on_every_rank

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "doors"))
import agreement  # noqa: E402

# the doors' results of one 2-rank world, compared across frameworks (tests/doors):
# the same bits under every controller (test_tf_exact.py)
pytestmark = pytest.mark.controller_independent


def test_tensorflow_door():
    if hvd.size() != agreement.WORLD:
        pytest.skip(f"the doors are compared in {agreement.WORLD}-rank worlds")
    name, params = agreement.CODEC
    comp = getattr(hqtf.Compression, name)(seed=agreement.SEED, **params)
    assert comp.pipeline_elems == hqtf.DoorOptions().pipeline_elems
    variables = [tf.Variable(tf.zeros(agreement.SHAPE), name=agreement.NAME)]

    @tf.function
    def step_fn(grads):
        with tf.GradientTape() as tape:
            loss = linear_loss(variables, grads)
        return hvd.DistributedGradientTape(tape, compression=comp).gradient(loss, variables)

    assert comp.calls == 0
    mean = step_fn([agreement.gradients(hvd.rank())])[0].numpy()
    seed = payload_seed(agreement.SEED, 0, agreement.NAME)  # the first tensor: k = 0
    assert np.array_equal(mean, agreement.reference(seed))
    assert same_on_every_rank(mean)
    if hvd.rank() == 0:
        agreement.write("tensorflow", mean, seed)
