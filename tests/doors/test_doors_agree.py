"""The four doors give the same bits for the same codec, seed and gradients
(tests/doors/agreement.py). Run by each multi-rank runner after its door jobs wrote their
results; ``HQ_DOORS_REQUIRE`` names the doors that runner wrote (they must be there), and the
doors an earlier runner wrote are compared too (``make test`` runs all three: the last
comparison sees all four doors)."""
import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from horovod_quant.core.rng import payload_seed  # noqa: E402

import agreement  # noqa: E402

REQUIRED = os.environ.get("HQ_DOORS_REQUIRE", "").split()
WRITTEN = {door: agreement.read(door) for door in agreement.DOORS}
PRESENT = [door for door, result in WRITTEN.items() if result is not None]


def test_required_doors_wrote_their_results():
    missing = [door for door in REQUIRED if WRITTEN.get(door) is None]
    assert not missing, (f"no result from {missing} in {agreement.out_dir()}: their jobs "
                         f"({', '.join(agreement.DOORS[d] for d in missing)}) did not run")


@pytest.mark.parametrize("door", PRESENT)
def test_door_gives_the_reference_bits(door):
    """The door's averaged gradient is mean_estimate's with the DoorOptions defaults, bit for
    bit, under the exchange seed the door documents."""
    mean, seed = WRITTEN[door]
    assert np.array_equal(mean, agreement.reference(seed)), door


def test_every_door_derives_one_seed_and_gives_one_result():
    """Every door keys a payload with the runtime's one function of (step, key, piece):
    the tensor NAME at its first step gets ``payload_seed(seed, 0, NAME)`` through each of
    them (the compressors' first use of the name, the optimizer's and the DDP hook's bucket
    holding the parameter alone, TensorFlow's first call), and so the same bits."""
    want = payload_seed(agreement.SEED, 0, agreement.NAME)
    assert {door: WRITTEN[door][1] for door in PRESENT} == {door: want for door in PRESENT}
    for door in PRESENT[1:]:
        assert np.array_equal(WRITTEN[door][0], WRITTEN[PRESENT[0]][0]), (PRESENT[0], door)


def test_default_pipeline_cuts_the_tensor():
    """The tensor is long enough that the doors' shared pipeline_elems default matters: the
    reference with whole vectors differs (a door with another default would fail above)."""
    import horovod_quant as hq

    seed = payload_seed(agreement.SEED, 0, agreement.NAME)
    whole, _ = hq.mean_estimate(agreement.codec(), [agreement.gradients(r).reshape(-1)
                                                    for r in range(agreement.WORLD)], seed,
                                pipeline_elems=None)
    assert not np.array_equal(whole.reshape(agreement.SHAPE), agreement.reference(seed))
