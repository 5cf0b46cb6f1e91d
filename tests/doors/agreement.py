"""One codec, one seed and one set of gradients through every door.

Each door's 2-rank job (tests/parallel: the Horovod torch ``compression=`` door and
``hq.torch.DistributedOptimizer``; tests/parallel_tf: the Horovod TensorFlow door;
tests/parallel_ddp: the DDP hook) averages :func:`gradients` of :data:`SHAPE` (longer than
``DoorOptions().pipeline_elems``, so the pipelined pieces count) with :data:`CODEC` and
:data:`SEED` at its first step, with every other setting at its DoorOptions default, and
:func:`write` s the result with the exchange seed the door documents for that tensor.
tests/doors/test_doors_agree.py compares them.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

import horovod_quant as hq
from horovod_quant.doors import DoorOptions

#: the codec as ``(name, params)``
CODEC = ("qsgd", {"bits": 4, "bucket_size": 512})
#: the base seed every door is given
SEED = 11
#: the gradient's shape: more elements than one pipeline piece
SHAPE = (1100, 2000)
#: the tensor's name (the parameter name in the torch doors, the variable name in TF)
NAME = "doors_weight"
#: the world the comparison is made in
WORLD = 2
#: what each runner writes: the door's file name, and the runner
DOORS = {"torch_compressor": "tests/parallel", "optimizer": "tests/parallel",
         "tensorflow": "tests/parallel_tf", "ddp": "tests/parallel_ddp"}


def gradients(rank: int) -> np.ndarray:
    """Rank ``rank``'s gradient (float32, :data:`SHAPE`), the same in every process."""
    rng = np.random.default_rng([rank, 2511])
    return (rng.standard_normal(SHAPE) * (rank + 1)).astype(np.float32)


def codec() -> hq.Codec:
    return hq.get_codec(CODEC[0], **CODEC[1])


def out_dir() -> Path:
    """Where the doors' results go: ``HQ_DOORS_DIR``, else ``<tmp>/hq-doors``."""
    path = Path(os.environ.get("HQ_DOORS_DIR") or Path(tempfile.gettempdir()) / "hq-doors")
    path.mkdir(parents=True, exist_ok=True)
    return path


def reference(seed: int) -> np.ndarray:
    """``mean_estimate`` of the ranks' gradients under exchange seed ``seed``, with the
    DoorOptions defaults (gather, pipeline_elems)."""
    options = DoorOptions()
    mean, _ = hq.mean_estimate(codec(), [gradients(r).reshape(-1) for r in range(WORLD)], seed,
                               gather=options.gather, pipeline_elems=options.pipeline_elems)
    return mean.reshape(SHAPE)


def write(door: str, mean: np.ndarray, seed: int) -> Path:
    """Save ``door``'s averaged gradient and the exchange seed it used (rank 0 calls it)."""
    if door not in DOORS:
        raise ValueError(f"door={door!r}: one of {sorted(DOORS)}")
    path = out_dir() / f"{door}.npz"
    np.savez(path, mean=np.asarray(mean, np.float32).reshape(SHAPE), seed=np.uint64(seed))
    return path


def read(door: str) -> tuple[np.ndarray, int] | None:
    """``door``'s (averaged gradient, exchange seed), or None when no job wrote it."""
    path = out_dir() / f"{door}.npz"
    if not path.exists():
        return None
    with np.load(path) as data:
        return data["mean"], int(data["seed"])
