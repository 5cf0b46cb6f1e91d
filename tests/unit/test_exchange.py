"""Exchanges over an in-process threaded world equal mean_estimate bit for bit."""
import numpy as np
import pytest

import horovod_quant as hq
from horovod_quant.comm import Exchange
from horovod_quant.comm.exchange import frame, unframe
from horovod_quant.core.payload import Payload

from threaded_comm import run_ranks

SIMPLE = ["none", "fp16", "bf16", "qsgd", "nuqsgd", "natural", "natural_dithering",
          "standard_dithering"]


def _inputs(n, size, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(size).astype(np.float32) * (r + 1) for r in range(n)]


def _distributed(codec, xs, seed, gather):
    def rank_fn(comm):
        ex = Exchange(codec, comm, gather=gather)
        return ex.start(xs[comm.rank], seed, "t0").wait()
    return run_ranks(len(xs), rank_fn)


def _codec(name, n):
    params = {"world_size": n} if name in ("global_qsgd", "nested_dithered") else {}
    return hq.get_codec(name, **params)


@pytest.mark.parametrize("name", [c for c in hq.available_codecs()])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("gather", ["allgather", "sra"])
def test_exchange_matches_reference(name, n, gather):
    codec = _codec(name, n)
    if codec.exchange != "gather" and gather == "sra":
        pytest.skip("schedule applies to gather codecs only")
    xs = _inputs(n, 3001)
    results = _distributed(codec, xs, seed=11, gather=gather)
    ref, _ = hq.mean_estimate(_codec(name, n), xs, seed=11, gather=gather)
    for r in results:
        assert np.array_equal(r, ref, equal_nan=True)


def test_frames_round_trip():
    payloads = [Payload(np.arange(k, dtype=np.uint8), k) for k in (0, 1, 5, 300)]
    buf = np.concatenate([frame(p) for p in payloads])
    assert [p.tolist() for p in unframe(buf)] == [p.data.tolist() for p in payloads]
