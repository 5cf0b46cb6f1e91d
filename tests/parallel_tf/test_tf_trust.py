"""Training programs as people write them, TensorFlow doors: every rank ends with the
bit-identical result or the same clear error, never a silent difference or a hang.

Every test runs on every rank and issues its collectives in an order every rank follows,
including after an expected error (``_resync`` where a rank is left one configuration check
ahead). TensorFlow reports an exception raised in a ``tf.numpy_function`` callback as a
``tf.errors.OpError`` (InvalidArgumentError, UnknownError) carrying the message, so the tests
match the message.
"""
import time

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import pytest
import tensorflow as tf

import horovod_quant as hq
import horovod_quant.tensorflow as hqtf
from horovod_quant.exchange.check import CHECKS, ConfigCheck
from horovod_quant.tensorflow.collectives import HorovodTFCollectives

from conftest import codec_params, linear_loss, rank_gradients, reference, same_on_every_rank

EVERYTHING = hqtf.LayerPolicy.everything()
ERRORS = (ValueError, tf.errors.OpError)
# one of each exchange plan: allgather, global norm first, sum (norm first), scatter-reduce-
# allgather, allgather + NDQSG outage allreduce
PLANS = [("qsgd", {}, "auto"), ("global_qsgd", {}, "auto"),
         ("global_qsgd", {"levels": "linear"}, "auto"), ("qsgd", {}, "sra"),
         ("nested_dithered", {}, "auto")]
PLAN_IDS = ["qsgd", "global_qsgd", "global_qsgd-linear", "qsgd-sra", "nested_dithered"]


@pytest.fixture
def several_ranks(horovod_world):
    if hvd.size() == 1:
        pytest.skip("needs several ranks")


def _compressor(name, params=None, **kw):
    params = {**(params or {}), **codec_params(name)}
    return getattr(hqtf.Compression, name)(**params, **kw), hq.get_codec(name, **params)


def _tape_fn(comp, vs, function=True, **tape_kw):
    def step_fn(grads):
        with tf.GradientTape() as tape:
            loss = linear_loss(vs, grads)
        return hvd.DistributedGradientTape(tape, compression=comp, **tape_kw).gradient(loss, vs)
    return tf.function(step_fn) if function else step_fn


def _comm():
    return HorovodTFCollectives()


def _resync():
    """Leave every rank at the same configuration-check number after a test in which some
    ranks started a check that the others never reached: the others join it (never waited)."""
    comm = _comm()
    target = max(comm.allgather_object(CHECKS.started(comm), "hq.test.tf.resync"))
    while CHECKS.started(comm) < target:
        ConfigCheck(comm, {"resync": True})


def _usable_after_error():
    """A fresh compressed exchange after an expected error: the world still works and the
    ranks still agree (no stale collective left behind on some rank)."""
    shapes = [(12, 40)]
    comp, codec = _compressor("qsgd", seed=31, policy=EVERYTHING)
    vs = [tf.Variable(tf.zeros(s), name="hq_trust_after") for s in shapes]
    got = [g.numpy() for g in _tape_fn(comp, vs)(rank_gradients(shapes, 9, hvd.rank()))]
    per_rank = [rank_gradients(shapes, 9, r)[0] for r in range(hvd.size())]
    assert np.array_equal(got[0].reshape(-1),
                          reference(codec, per_rank, 31, 0, name="hq_trust_after"))


# -- different shapes or names on different ranks ----------------------------------------------
@pytest.mark.usefixtures("several_ranks")
@pytest.mark.parametrize("name,params,gather", PLANS, ids=PLAN_IDS)
def test_other_shape_on_one_rank_raises_on_every_rank(name, params, gather):
    """Rank 1 holds the variable transposed: the same element count, so without the tags the
    bytes would combine silently. Every plan's first collective carries the tag."""
    shape = (8, 16) if hvd.rank() != 1 else (16, 8)
    comp, _ = _compressor(name, params, seed=3, gather=gather, policy=EVERYTHING)
    vs = [tf.Variable(tf.zeros(shape), name="hq_trust_w")]
    start = time.monotonic()
    with pytest.raises(ERRORS, match="sent different tensors"):
        _tape_fn(comp, vs)([np.ones(shape, np.float32)])
    assert time.monotonic() - start < 120
    _usable_after_error()


@pytest.mark.usefixtures("several_ranks")
@pytest.mark.parametrize("name,params,gather", PLANS[:2], ids=PLAN_IDS[:2])
def test_a_rank_one_call_ahead_raises_on_every_rank(name, params, gather):
    """Rank 0's call counter (the seeds' step, restored from another checkpoint) one ahead:
    the tags of the first exchange differ in their step, and every rank raises, within
    seconds, the same error naming each rank's."""
    comp, _ = _compressor(name, params, seed=3, gather=gather, policy=EVERYTHING)
    if hvd.rank() == 0:
        comp.checkpointable.calls.assign(1)
    vs = [tf.Variable(tf.zeros((8, 16)), name="hq_trust_step")]
    start = time.monotonic()
    steps = ", ".join(f"rank {r} at step {int(r == 0)}" for r in range(hvd.size()))
    with pytest.raises(ERRORS, match=f"out of step .*: {steps}"):
        _tape_fn(comp, vs)([np.ones((8, 16), np.float32)])
    assert time.monotonic() - start < 30
    _usable_after_error()


@pytest.mark.usefixtures("several_ranks")
@pytest.mark.parametrize("case", ["size", "name", "direct"])
def test_other_tensor_on_one_rank_raises_on_every_rank(case):
    """Another element count, another variable name under the same shape, and the ``name=``
    of a direct ``hvd.allreduce``: the same error on every rank."""
    other = hvd.rank() == 1
    comp, _ = _compressor("natural", seed=4, policy=EVERYTHING)
    shape = (8, 24) if case == "size" and other else (8, 16)
    with pytest.raises(ERRORS, match="sent different tensors"):
        if case == "direct":
            hvd.allreduce(tf.ones(shape), name="hq_b" if other else "hq_a", compression=comp)
        else:
            var_name = "hq_trust_b" if case == "name" and other else "hq_trust_a"
            vs = [tf.Variable(tf.zeros(shape), name=var_name)]
            _tape_fn(comp, vs)([np.ones(shape, np.float32)])
    _usable_after_error()


@pytest.mark.usefixtures("several_ranks")
def test_other_shape_of_an_uncompressed_tensor_is_horovods_error():
    """A 1-D tensor left to Horovod by the default policy: Horovod's own shape check."""
    shape = (10,) if hvd.rank() != 1 else (12,)
    comp, _ = _compressor("qsgd", seed=5)
    vs = [tf.Variable(tf.zeros(shape), name="hq_trust_bias")]
    with pytest.raises(tf.errors.OpError, match="(?i)mismatched"):
        _tape_fn(comp, vs)([np.ones(shape, np.float32)])
    _usable_after_error()


# -- per-layer codec rules ---------------------------------------------------------------------
RULE_NAMES = ["hq_rule_nu", "hq_rule_raw", "hq_rule_half", "hq_rule_nat", "hq_rule_default"]
RULE_SHAPES = [(30, 40), (20, 30), (16, 32), (24, 50), (25, 40)]


def _rule_policy(half=True):
    """Rules given as a Compression object, None, Compression.fp16() and a codec. Without
    ``half`` the fp16 rule is None: Horovod's grouped allreduce takes one dtype per group."""
    return hqtf.LayerPolicy(min_elements=0, rules=[
        ("rule_nu", hqtf.Compression.nuqsgd(bits=4, bucket_size=256)),
        ("rule_raw", None),
        ("rule_half", hqtf.Compression.fp16() if half else None),
        ("rule_nat", hq.get_codec("natural")),
    ])


def _check_rules(got, step, seed, k0, half=True):
    """Variables 0, 3, 4 are compressed with their rule's codec (nuqsgd, natural, the default
    qsgd) and take k0, k0 + 1, k0 + 2; variable 1 is Horovod's exact mean, variable 2 its
    float16 mean (``half``) or exact mean."""
    codecs = {0: hq.get_codec("nuqsgd", bits=4, bucket_size=256), 3: hq.get_codec("natural"),
              4: hq.get_codec("qsgd", bits=4)}
    per_rank = [rank_gradients(RULE_SHAPES, step, r) for r in range(hvd.size())]
    for k, j in enumerate(sorted(codecs)):
        want = reference(codecs[j], [g[j] for g in per_rank], seed, k0 + k, name=RULE_NAMES[j])
        assert np.array_equal(np.asarray(got[j]).reshape(-1), want), RULE_NAMES[j]
    mean = [np.mean([g[j] for g in per_rank], axis=0) for j in (1, 2)]
    np.testing.assert_allclose(got[1], mean[0], rtol=1e-6, atol=1e-7)
    if half:
        np.testing.assert_allclose(got[2], mean[1], rtol=2e-3, atol=2e-3)
        assert not np.array_equal(got[2], mean[1]), "the fp16 rule must take Horovod's fp16 path"
    else:
        np.testing.assert_allclose(got[2], mean[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("door", ["tape-eager", "tape-function", "tape-groups", "keras"])
def test_rules_choose_the_codec_per_variable(door):
    import tf_keras

    half = door != "tape-groups"
    comp = hqtf.Compression.qsgd(bits=4, seed=13, policy=_rule_policy(half))
    vs = [tf.Variable(tf.zeros(s), name=n) for s, n in zip(RULE_SHAPES, RULE_NAMES)]
    if door == "keras":
        opt = hvd_keras.DistributedOptimizer(tf_keras.optimizers.SGD(1.0), compression=comp)

        def run(grads):
            for v in vs:
                v.assign(tf.zeros_like(v))
            opt.minimize(lambda: linear_loss(vs, grads), vs)
            return [-v.numpy() for v in vs]
    else:
        tape_kw = {"groups": 1} if door == "tape-groups" else {}
        step_fn = _tape_fn(comp, vs, function=door != "tape-eager", **tape_kw)

        def run(grads):
            return [g.numpy() for g in step_fn(grads)]
    for step in range(2):
        k0 = comp.calls
        got = run([tf.constant(g) for g in rank_gradients(RULE_SHAPES, step, hvd.rank())])
        if hvd.size() == 1:
            continue  # Horovod skips the reduction in a one-rank world
        assert comp.calls == k0 + 3
        _check_rules(got, step, 13, k0, half)
    if hvd.size() > 1:
        assert same_on_every_rank(np.concatenate([np.ravel(g) for g in got]))


def test_rules_match_the_name_of_a_direct_allreduce():
    """``name=`` of ``hvd.allreduce``, and ``name[i]`` in a named ``grouped_allreduce``."""
    comp = hqtf.Compression.qsgd(seed=6, policy=_rule_policy())
    shapes = [(30, 20), (12, 40), (18, 30)]
    xs = [tf.constant(x) for x in rank_gradients(shapes, 0, hvd.rank())]
    k0 = comp.calls
    got = [hvd.allreduce(xs[0], name="grad_rule_nat", op=hvd.Sum, compression=comp)]
    got += hvd.grouped_allreduce(xs[1:], name="group_rule_nu", op=hvd.Sum, compression=comp)
    if hvd.size() > 1:
        codecs = [hq.get_codec("natural")] + 2 * [hq.get_codec("nuqsgd", bits=4, bucket_size=256)]
        names = ["grad_rule_nat", "group_rule_nu[0]", "group_rule_nu[1]"]
        for j, codec in enumerate(codecs):
            per_rank = [rank_gradients(shapes, 0, r)[j] for r in range(hvd.size())]
            want = reference(codec, per_rank, 6, k0 + j, factor=hvd.size(), name=names[j])
            assert np.array_equal(got[j].numpy().reshape(-1), want), j


def test_rules_as_compression_objects_or_codecs_are_one_configuration():
    """The same rule given as ``Compression.nuqsgd(...)`` on one rank and as ``get_codec``
    on the other is one configuration."""
    rule = (hqtf.Compression.nuqsgd(bits=8) if hvd.rank() == 0
            else hq.get_codec("nuqsgd", bits=8))
    comp = hqtf.Compression.qsgd(seed=8, policy=hqtf.LayerPolicy(min_elements=0,
                                                                 rules=[("rule_w", rule)]))
    shapes = [(20, 30)]
    vs = [tf.Variable(tf.zeros(shapes[0]), name="hq_rule_w")]
    got = _tape_fn(comp, vs)(rank_gradients(shapes, 0, hvd.rank()))[0].numpy()
    if hvd.size() > 1:
        per_rank = [rank_gradients(shapes, 0, r)[0] for r in range(hvd.size())]
        want = reference(hq.get_codec("nuqsgd", bits=8), per_rank, 8, 0, name="hq_rule_w")
        assert np.array_equal(got.reshape(-1), want)


@pytest.mark.usefixtures("several_ranks")
def test_rule_mismatch_between_ranks_raises_on_every_rank():
    bits = 4 if hvd.rank() == 0 else 8
    policy = hqtf.LayerPolicy(rules=[("rule_w", hqtf.Compression.nuqsgd(bits=bits))])
    comp = hqtf.Compression.qsgd(policy=policy)
    shapes = [(20, 30)]
    vs = [tf.Variable(tf.zeros(shapes[0]), name="hq_rule_w")]
    step_fn = _tape_fn(comp, vs)
    for _ in range(2):  # and again at the next call: never proceeds with differing configs
        with pytest.raises(ValueError, match="differs between ranks"):
            step_fn(rank_gradients(shapes, 0, hvd.rank()))
    assert comp.calls == 0


@pytest.mark.usefixtures("several_ranks")
def test_different_codecs_on_different_ranks_raise_on_every_rank():
    comp, _ = (_compressor("global_qsgd", policy=EVERYTHING) if hvd.rank() == 0
               else _compressor("qsgd", policy=EVERYTHING))
    shapes = [(20, 30)]
    vs = [tf.Variable(tf.zeros(shapes[0]), name="hq_trust_codec")]
    with pytest.raises(ValueError, match="differs between ranks"):
        _tape_fn(comp, vs)(rank_gradients(shapes, 0, hvd.rank()))


#: every setting of a TensorFlow compressor that changes what goes on the wire -> its
#: arguments when this rank differs (True) or not
SETTINGS = {
    "codec params": lambda d: {"bits": 8 if d else 4},
    "seed": lambda d: {"seed": 2 if d else 1},
    "gather": lambda d: {"gather": "sra" if d else "allgather"},
    # another policy that compresses the same tensor
    "policy": lambda d: {"policy": hqtf.LayerPolicy(min_elements=1, compress_1d=True) if d
                         else EVERYTHING},
    "pipeline_elems": lambda d: {"pipeline_elems": 100 if d else None},
    "HQ_MPI_EXCHANGE": lambda d: {"name": "global_qsgd"},  # its MPI exponent allreduce
}


@pytest.mark.usefixtures("several_ranks")
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_setting_that_differs_raises_on_every_rank(setting, monkeypatch):
    """Rank 1 differs in one setting: every rank raises the same ValueError, before any
    exchange."""
    differs = hvd.rank() == 1
    if setting == "HQ_MPI_EXCHANGE" and differs:
        monkeypatch.setenv("HQ_MPI_EXCHANGE", "0")
    kw = {"policy": EVERYTHING, **SETTINGS[setting](differs)}
    if "pipeline_elems" in kw:  # an argument of the compressor class, not of Compression.<codec>
        comp = hqtf.QuantizedCompressor(hq.get_codec("qsgd"), **kw)
    else:
        comp, _ = _compressor(kw.pop("name", "qsgd"), **kw)
    shapes = [(20, 30)]
    vs = [tf.Variable(tf.zeros(shapes[0]), name="hq_trust_setting")]
    with pytest.raises(ValueError, match="differs between ranks") as excinfo:
        _tape_fn(comp, vs)(rank_gradients(shapes, 0, hvd.rank()))
    assert comp.calls == 0
    messages = _comm().allgather_object(str(excinfo.value), "hq.test.tf.setting")
    assert messages == [str(excinfo.value)] * hvd.size()


# -- integer and boolean tensors ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [tf.int32, tf.int64])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_integer_tensors_pass_exactly(dtype, mode):
    comp, _ = _compressor("qsgd", policy=EVERYTHING)

    def reduce(t):
        return hvd.allreduce(t, op=hvd.Sum, compression=comp)

    fn = tf.function(reduce) if mode == "function" else reduce
    values = [(np.arange(5000) * 7919 % 1000003 - 500000) * (r + 1) for r in range(hvd.size())]
    got = fn(tf.constant(values[hvd.rank()], dtype))
    assert got.dtype == dtype
    assert np.array_equal(got.numpy(), np.sum(values, axis=0))
    assert comp.calls == 0 and comp.stats.tensors == 0
    flags = tf.constant(np.arange(2000) % 3 == 0)
    out, ctx = comp.compress(flags)
    assert ctx is None and out is flags


# -- configuration checks: numbering and deadline ----------------------------------------------
def test_extra_unused_compressor_on_one_rank_shifts_nothing():
    if hvd.rank() == 0:
        hqtf.Compression.qsgd(bits=8, seed=99)  # built, never used: starts no check
    shapes = [(24, 40), (16, 30)]
    for seed in (21, 22):  # two compressors in a row: both checks pair up
        comp, codec = _compressor("qsgd", seed=seed, policy=EVERYTHING)
        vs = [tf.Variable(tf.zeros(s), name=f"hq_trust_extra_{j}") for j, s in enumerate(shapes)]
        got = [g.numpy() for g in _tape_fn(comp, vs)(rank_gradients(shapes, 0, hvd.rank()))]
        if hvd.size() > 1:
            for j, g in enumerate(got):
                per_rank = [rank_gradients(shapes, 0, r)[j] for r in range(hvd.size())]
                assert np.array_equal(g.reshape(-1), reference(codec, per_rank, seed, j,
                                                               name=f"hq_trust_extra_{j}"))
            assert same_on_every_rank(np.concatenate([g.reshape(-1) for g in got]))


@pytest.mark.usefixtures("several_ranks")
def test_compressor_on_one_rank_only_fails_within_the_deadline(monkeypatch):
    """Rank 0 compresses with horovod_quant, the others with Horovod's ``none``. The others
    wait in Horovod's allreduce (a differently named op: Horovod cannot see the mismatch), rank
    0 in the configuration check, which gives up after HQ_CONFIG_TIMEOUT with a RuntimeError
    instead of hanging. In a real job the launcher then stops the others; here rank 0 joins
    their allreduce afterwards and they join its check, so the session goes on."""
    timeout = 2.0
    monkeypatch.setenv("HQ_CONFIG_TIMEOUT", str(timeout))
    shapes = [(16, 64)]
    vs = [tf.Variable(tf.zeros(shapes[0]), name="hq_trust_lonely")]
    grads = rank_gradients(shapes, 0, hvd.rank())
    plain = _tape_fn(hvd.Compression.none, vs, function=False)
    if hvd.rank() == 0:
        comp, _ = _compressor("qsgd", policy=EVERYTHING)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="waited .* configuration"):
            _tape_fn(comp, vs, function=False)(grads)
        waited = time.monotonic() - start
        assert timeout <= waited < timeout + 30, waited
    got = plain(grads)[0].numpy()  # rank 0: releases the others, which wait in it
    mean = np.mean([rank_gradients(shapes, 0, r)[0] for r in range(hvd.size())], axis=0)
    np.testing.assert_allclose(got, mean, rtol=1e-6, atol=1e-7)
    _resync()
    _usable_after_error()
