"""Every TensorFlow door gives exactly mean_estimate's numbers, on every rank, for every codec.

How seeds are reproduced: before a call, ``k0 = comp.calls``; the call's compressed tensors get
k0, k0 + 1, ... in the order Horovod calls ``compress`` (the order of the gradient list, group
by group with ``groups``); tensor j is compared with ``mean_estimate(codec, [rank r's tensor j
for every r], seed=derive_key(seed, k0 + j))``, times n for ``op=hvd.Sum``.
"""
import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import pytest
import tensorflow as tf

import horovod_quant as hq
import horovod_quant.tensorflow as hqtf
from horovod_quant.core.rng import payload_seed
from horovod_quant.exchange import CodecStates

from conftest import (
    UNNAMED_VARIABLE,
    codec_params,
    linear_loss,
    rank_gradients,
    reference,
    same_on_every_rank,
)

EVERYTHING = hqtf.LayerPolicy.everything()
CONFIGS = [(c, {}) for c in hq.available_codecs() if c not in ("none", "fp16")] + [
    ("global_qsgd", {"levels": "linear"}),        # sum plan: int64 words, allreduce(Sum)
    ("global_qsgd", {"mode": "sparse", "norm": "l2"}),  # gather plan, allreduce(Sum) norm
    ("qsgd", {"bits": 3, "elias": True}),         # variable-length payloads
]
IDS = [c + "".join(f"-{k}={v}" for k, v in p.items()) for c, p in CONFIGS]


def _make(name, params, seed, policy=EVERYTHING, **kw):
    params = {**params, **codec_params(name)}
    comp = getattr(hqtf.Compression, name)(seed=seed, policy=policy, **kw, **params)
    return comp, hq.get_codec(name, **params)


def _tape_fn(comp, vs, **tape_kw):
    """A tf.function step: the gradients of ``linear_loss`` through DistributedGradientTape."""
    @tf.function
    def step_fn(grads):
        with tf.GradientTape() as tape:
            loss = linear_loss(vs, grads)
        return hvd.DistributedGradientTape(tape, compression=comp, **tape_kw).gradient(loss, vs)
    return step_fn


def _check(got, codec, shapes, step, seed, k0, factor=1.0, gather="auto", which=None,
           name=UNNAMED_VARIABLE):
    """got[j] must equal the reference of exchange k0 + j (which: indices of compressed) of
    tensors named ``name``."""
    which = range(len(shapes)) if which is None else which
    for k, j in enumerate(which):
        per_rank = [rank_gradients(shapes, step, r)[j] for r in range(hvd.size())]
        want = reference(codec, per_rank, seed, k0 + k, factor, gather, name)
        assert np.array_equal(np.asarray(got[j]).reshape(-1), want, equal_nan=True), (j, k0 + k)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("name,params", CONFIGS, ids=IDS)
def test_gradient_tape_matches_reference(name, params, mode):
    shapes = [(37, 81), (24, 50)]
    comp, codec = _make(name, params, seed=5)
    vs = [tf.Variable(tf.zeros(s)) for s in shapes]
    op = hvd.Average if mode == "eager" else hvd.Sum

    def step_fn(grads):
        with tf.GradientTape() as tape:
            loss = linear_loss(vs, grads)
        tape = hvd.DistributedGradientTape(tape, compression=comp, op=op)
        return tape.gradient(loss, vs)

    fn = tf.function(step_fn) if mode == "function" else step_fn
    for step in range(2):
        k0 = comp.calls
        got = [g.numpy() for g in fn(rank_gradients(shapes, step, hvd.rank()))]
        if hvd.size() == 1:
            continue  # Horovod skips the reduction in a one-rank world
        assert comp.calls == k0 + len(shapes)
        _check(got, codec, shapes, step, 5, k0, hvd.size() if op == hvd.Sum else 1.0)
    if hvd.size() > 1:
        assert same_on_every_rank(np.concatenate([g.reshape(-1) for g in got]))
        assert comp.stats.tensors == 4 and 0 < comp.stats.bytes_sent


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("name", ["qsgd", "global_qsgd", "nested_dithered"])
def test_keras_optimizer_door_matches_reference(name, mode):
    """horovod.tensorflow.keras.DistributedOptimizer(SGD(1.0)): a step from zero weights
    leaves exactly -mean in the weights."""
    import tf_keras

    shapes = [(40, 64), (16, 70)]
    comp, codec = _make(name, {}, seed=11)
    vs = [tf.Variable(tf.zeros(s)) for s in shapes]
    opt = hvd_keras.DistributedOptimizer(tf_keras.optimizers.SGD(1.0), compression=comp)

    def step_fn(grads):
        opt.minimize(lambda: linear_loss(vs, grads), vs)

    fn = tf.function(step_fn) if mode == "function" else step_fn
    for step in range(2):
        for v in vs:
            v.assign(tf.zeros_like(v))
        k0 = comp.calls
        fn([tf.constant(g) for g in rank_gradients(shapes, step, hvd.rank())])
        if hvd.size() == 1:
            continue
        _check([-v.numpy() for v in vs], codec, shapes, step, 11, k0)


def test_policy_groups_and_counter():
    """Default policy: small and 1-D tensors take Horovod's own allreduce and no call index;
    groups=1 (one grouped allreduce) compresses in group order."""
    shapes = [(16, 64), (50,), (10, 20), (8, 128)]
    compressed = [0, 3]
    comp, codec = _make("natural", {}, seed=3, policy=hqtf.LayerPolicy())
    vs = [tf.Variable(tf.zeros(s)) for s in shapes]
    step_fn = _tape_fn(comp, vs, groups=1)

    for step in range(2):
        k0 = comp.calls
        got = [g.numpy() for g in step_fn(rank_gradients(shapes, step, hvd.rank()))]
        if hvd.size() == 1:
            continue
        assert comp.calls == k0 + len(compressed)
        _check(got, codec, shapes, step, 3, k0, which=compressed)
        for j in (1, 2):
            per_rank = [rank_gradients(shapes, step, r)[j] for r in range(hvd.size())]
            np.testing.assert_allclose(got[j], np.mean(per_rank, axis=0), rtol=1e-6, atol=1e-7)
    if hvd.size() > 1:
        s = comp.stats
        # stats count the compressed exchanges: 2 steps x (16x64 + 8x128) float32
        assert s.tensors == 4 and s.bytes_raw == 2 * 4 * 2048
        assert s.compression_ratio > 3.5  # natural: 8 bits per element + a float32 per 512


@pytest.mark.parametrize("name", ["qsgd", "bf16"])
def test_sra_schedule(name):
    shapes = [(33, 70)]
    comp, codec = _make(name, {}, seed=21, gather="sra")
    vs = [tf.Variable(tf.zeros(s)) for s in shapes]
    step_fn = _tape_fn(comp, vs)
    k0 = comp.calls
    got = [g.numpy() for g in step_fn(rank_gradients(shapes, 0, hvd.rank()))]
    if hvd.size() > 1:
        _check(got, codec, shapes, 0, 21, k0, gather="sra")


def _correlated(shapes, step, rank):
    """Gradients close to each other on every rank: NDQSG's state (the coarse ratio k) moves."""
    base = rank_gradients(shapes, step, 0)
    noise = rank_gradients(shapes, step, rank, scale=0.01)
    return [b + e for b, e in zip(base, noise)]


@pytest.mark.parametrize("name,params,gather", [
    ("qsgd", {}, "sra"), ("global_qsgd", {}, "auto"),
    ("global_qsgd", {"mode": "sparse", "norm": "l2"}, "auto"), ("nested_dithered", {}, "auto")])
def test_pipelined_pieces_match_reference(name, params, gather):
    """pipeline_elems cuts a tensor into pieces as Exchange does (the same plans, seeds and
    bits; one global norm over the whole tensor; NDQSG encodes every piece with one state)."""
    shapes = [(33, 70), (20, 40)]
    params = {**params, **codec_params(name)}
    comp = hqtf.QuantizedCompressor(hq.get_codec(name, **params), seed=13, gather=gather,
                                    policy=EVERYTHING, pipeline_elems=400)
    codec = hq.get_codec(name, **params)
    vs = [tf.Variable(tf.zeros(s)) for s in shapes]
    step_fn = _tape_fn(comp, vs)
    for step in range(3):
        k0 = comp.calls
        got = [g.numpy() for g in step_fn(_correlated(shapes, step, hvd.rank()))]
        if hvd.size() == 1:
            continue
        for j in range(len(shapes)):
            flats = [_correlated(shapes, step, r)[j].reshape(-1) for r in range(hvd.size())]
            want, _ = hq.mean_estimate(codec, flats,
                                       seed=payload_seed(13, k0 + j, UNNAMED_VARIABLE),
                                       gather=gather, pipeline_elems=400)
            assert np.array_equal(got[j].reshape(-1), want, equal_nan=True), (name, step, j)
    if name == "nested_dithered" and hvd.size() > 1:
        # the state moved between pieces
        assert comp.codec_states.of(codec).next_k < 2 * codec.M + 1


def test_direct_allreduce_eager_sum():
    shapes = [(30, 40)]
    comp, codec = _make("dithered", {}, seed=8)
    k0 = comp.calls
    t = tf.constant(rank_gradients(shapes, 0, hvd.rank())[0])
    got = hvd.allreduce(t, op=hvd.Sum, compression=comp).numpy()
    _check([got], codec, shapes, 0, 8, k0, factor=hvd.size(), name="#")  # no name=


@pytest.mark.parametrize("sparse_as_dense", [True, False])
def test_embedding_gradients(sparse_as_dense):
    """IndexedSlices: densified and compressed with sparse_as_dense, else Horovod's gather."""
    rows, width, ids = 64, 32, np.arange(hvd.rank(), 64, 3, dtype=np.int32)
    comp, codec = _make("qsgd", {"bits": 8}, seed=2)
    table = tf.Variable(tf.zeros((rows, width)))

    def dense_grad(step, r):
        g = np.zeros((rows, width), np.float32)
        rid = np.arange(r, 64, 3)
        g[rid] = rank_gradients([(rid.size, width)], step, r)[0]
        return g, rid

    @tf.function
    def step_fn(vals):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, ids) * vals)
        tape = hvd.DistributedGradientTape(tape, compression=comp, sparse_as_dense=sparse_as_dense)
        return tape.gradient(loss, [table])[0]

    k0 = comp.calls
    mine, rid = dense_grad(0, hvd.rank())
    got = tf.convert_to_tensor(step_fn(tf.constant(mine[rid]))).numpy()
    if hvd.size() == 1:
        return
    per_rank = [dense_grad(0, r)[0] for r in range(hvd.size())]
    if sparse_as_dense:
        assert comp.calls == k0 + 1
        assert np.array_equal(got.reshape(-1), reference(codec, per_rank, 2, k0))
    else:
        assert comp.calls == k0
        np.testing.assert_allclose(got, np.mean(per_rank, axis=0), rtol=1e-6, atol=1e-7)


def test_predivide_factor_and_backward_passes():
    """gradient_predivide_factor leaves the factor at 1; Keras backward_passes_per_step=2
    exchanges the locally summed gradients of two passes once."""
    import tf_keras

    shapes = [(20, 64)]
    comp, codec = _make("qsgd", {}, seed=4)
    vs = [tf.Variable(tf.zeros(s)) for s in shapes]

    @tf.function
    def tape_fn(grads):
        with tf.GradientTape() as tape:
            loss = linear_loss(vs, grads)
        tape = hvd.DistributedGradientTape(tape, compression=comp, gradient_predivide_factor=2.0)
        return tape.gradient(loss, vs)

    k0 = comp.calls
    got = [g.numpy() for g in tape_fn(rank_gradients(shapes, 0, hvd.rank()))]
    if hvd.size() > 1:
        _check(got, codec, shapes, 0, 4, k0)

    opt = hvd_keras.DistributedOptimizer(tf_keras.optimizers.SGD(1.0), compression=comp,
                                         backward_passes_per_step=2)
    grads = [tf.constant(g) for g in rank_gradients(shapes, 1, hvd.rank())]
    k0 = comp.calls
    for _ in range(2):
        opt.minimize(lambda: linear_loss(vs, grads), vs)
    if hvd.size() > 1:
        assert comp.calls == k0 + 1
        per_rank = [rank_gradients(shapes, 1, r)[0] * np.float32(2) for r in range(hvd.size())]
        assert np.array_equal(-vs[0].numpy().reshape(-1), reference(codec, per_rank, 4, k0))


def test_nested_outage_share_is_exact():
    """NDQSG through the tape: each P2 rank counts its wrong coarse bins, one allreduce sums
    them, and the share equals the reference's (which knows every rank's input)."""
    if hvd.size() == 1:
        pytest.skip("needs a P2 rank")
    shapes = [(60, 70)]
    comp, codec = _make("nested_dithered", {"bits": 6, "coarse_ratio": 5}, seed=2)
    vs = [tf.Variable(tf.zeros(s)) for s in shapes]
    step_fn = _tape_fn(comp, vs)
    for step in range(2):
        k0 = comp.calls
        got = [g.numpy() for g in step_fn(rank_gradients(shapes, step, hvd.rank()))]
        _check(got, codec, shapes, step, 2, k0)
        ref_states = CodecStates()
        hq.mean_estimate(codec, [g.reshape(-1) for r in range(hvd.size())
                                 for g in rank_gradients(shapes, step, r)],
                         seed=payload_seed(2, k0, UNNAMED_VARIABLE), states=ref_states)
        share = comp.codec_states.of(codec).last_stats["outside_share"]
        assert share is not None and share == ref_states.of(codec).last_stats["outside_share"]
