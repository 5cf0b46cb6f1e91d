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
from horovod_quant.core.rng import derive_key, payload_seed  # noqa: E402

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


def test_doors_with_one_seed_give_one_result():
    """Doors that derive the same exchange seed from the base seed give identical bits; the
    optimizer seeds its bucket 0 at step 0 with ``derive_key(seed, 0, 0)``, the DDP hook the
    bucket holding the tensor with ``payload_seed(seed, 0, its name, 0)``."""
    groups: dict[int, list[str]] = {}
    for door in PRESENT:
        groups.setdefault(WRITTEN[door][1], []).append(door)
    for doors in groups.values():
        first = WRITTEN[doors[0]][0]
        for door in doors[1:]:
            assert np.array_equal(WRITTEN[door][0], first), (doors[0], door)
    if "optimizer" in PRESENT:
        assert WRITTEN["optimizer"][1] == derive_key(agreement.SEED, 0, 0)
    if "ddp" in PRESENT:
        assert WRITTEN["ddp"][1] == payload_seed(agreement.SEED, 0, agreement.NAME, 0)


def test_default_pipeline_cuts_the_tensor():
    """The tensor is long enough that the doors' shared pipeline_elems default matters: the
    reference with whole vectors differs (a door with another default would fail above)."""
    import horovod_quant as hq

    seed = derive_key(agreement.SEED, 0, 0)
    whole, _ = hq.mean_estimate(agreement.codec(), [agreement.gradients(r).reshape(-1)
                                                    for r in range(agreement.WORLD)], seed,
                                pipeline_elems=None)
    assert not np.array_equal(whole.reshape(agreement.SHAPE), agreement.reference(seed))
