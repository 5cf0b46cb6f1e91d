"""TensorFlow parallel tests, run once per rank under horovodrun (tests/parallel_tf/run.sh) and
also under plain pytest as a one-rank world. Every test issues its collectives in the same
order on every rank, and no test skips on some ranks only (that would desynchronize them).

Seeds: a compressor's k-th exchanged tensor (k = ``compressor.calls`` before it, counting from
0 over the compressor's life, in the order Horovod calls ``compress``) named ``name`` (a
variable's name without ``:0``; unnamed: ``#``) uses ``payload_seed(seed, k, name)``;
:func:`reference` recomputes it with ``mean_estimate``.
"""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
hvd = pytest.importorskip("horovod.tensorflow")

# after the TF environment and the skips
import horovod_quant as hq  # noqa: E402
from horovod_quant.core.registry import codec_class  # noqa: E402
from horovod_quant.core.rng import payload_seed  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def horovod_world():
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    yield hvd


def rank_gradients(shapes, step, rank, scale=1.0):
    """Deterministic per-rank gradients that every rank can recompute for any other rank."""
    rng = np.random.default_rng([step, rank, 4321])
    return [(rng.standard_normal(s) * scale * (rank + 1)).astype(np.float32) for s in shapes]


def linear_loss(variables, grads):
    """loss = sum_i <v_i, g_i>: the gradient of v_i is exactly g_i."""
    return tf.add_n([tf.reduce_sum(v * tf.convert_to_tensor(g)) for v, g in zip(variables, grads)])


def codec_params(name):
    """Parameters that make every codec valid in this world."""
    if codec_class(name).needs_world_size:
        return {"world_size": hvd.size()}
    return {}


#: the key of an unnamed variable's gradient (``tf.Variable(...)`` is named ``Variable:0``)
UNNAMED_VARIABLE = "Variable"


def reference(codec, per_rank, seed, k, factor=1.0, gather="auto", name=UNNAMED_VARIABLE):
    """mean_estimate of one exchange: ``per_rank[r]`` is rank r's tensor, k its call index,
    ``name`` its key."""
    flats = [np.asarray(x, np.float32).reshape(-1) for x in per_rank]
    est, _ = hq.mean_estimate(codec, flats, seed=payload_seed(seed, k, name), gather=gather)
    return est * np.float32(factor) if factor != 1.0 else est


def same_on_every_rank(arr):
    """Whether ``arr`` is bitwise identical on every rank (a collective)."""
    flat = tf.constant(np.ascontiguousarray(arr, np.float32).reshape(1, -1).view(np.int32))
    everyone = hvd.allgather(flat).numpy()
    return all(np.array_equal(everyone[0], everyone[r]) for r in range(everyone.shape[0]))
