"""Every setting of the PyTorch Horovod doors that changes what goes on the wire is in the ranks'
configuration check: when rank 1 differs in one, every rank raises the same ValueError before
anything is exchanged (a differing ``pipeline_elems`` used to abort the job over the gloo
transport and hang over Horovod's)."""
import horovod.torch as hvd
import numpy as np
import pytest
import torch

import horovod_quant.torch as hqt

from conftest import Linear, rank_gradients

pytestmark = pytest.mark.size_independent
EVERYTHING = hqt.LayerPolicy.everything()
SHAPES = [(64, 128), (32, 64)]
#: another policy that compresses the same tensors (else Horovod itself sees the placeholder
#: against the gradient first)
SAME_TENSORS = hqt.LayerPolicy(min_elements=1, compress_1d=True)


@pytest.fixture
def several_ranks(horovod_world):
    if hvd.size() == 1:
        pytest.skip("needs several ranks")


def _differs():
    return hvd.rank() == 1


def _compressor(name="qsgd", **kw):
    kw.setdefault("policy", EVERYTHING)
    return getattr(hqt.Compression, name)(**kw)


#: setting -> the optimizer's arguments, (model, whether this rank differs) -> kwargs
OPTIMIZER_SETTINGS = {
    "codec params": lambda m, d: {"compression": _compressor(bits=8 if d else 4)},
    "seed": lambda m, d: {"seed": 2 if d else 1},
    "gather": lambda m, d: {"gather": "sra" if d else "allgather"},
    "policy": lambda m, d: {"policy": SAME_TENSORS if d else EVERYTHING},
    "pipeline_elems": lambda m, d: {"pipeline_elems": 1024 if d else None},
    "transport": lambda m, d: {"transport": "auto" if d else "horovod"},
    "fusion_bytes": lambda m, d: {"fusion_bytes": 1 if d else 1 << 30},
    # num_groups=8: buckets of about an eighth of the 40 kB, so one per parameter; a
    # num_groups that forms the same buckets as fusion_bytes puts the same on the wire
    "num_groups": lambda m, d: {"num_groups": 8 if d else 0},
    "groups": lambda m, d: {"groups": [[m.ps[0]], [m.ps[1]]] if d else [[m.ps[0], m.ps[1]]]},
    "sparse_as_dense": lambda m, d: {"sparse_as_dense": d},
    "op": lambda m, d: {"op": hvd.Sum if d else hvd.Average},
    "gradient_predivide_factor": lambda m, d: {"gradient_predivide_factor": 2.0 if d else 1.0},
    "fallback": lambda m, d: {"fallback": "never" if d else "auto"},
    # the MPI exponent allreduce of Global-QSGD, over Horovod's collectives
    "HQ_MPI_EXCHANGE": lambda m, d: {"compression": _compressor("global_qsgd"),
                                     "transport": "horovod"},
}


def _same_error_everywhere(excinfo):
    assert hvd.allgather_object(str(excinfo.value)) == [str(excinfo.value)] * hvd.size()


@pytest.mark.usefixtures("several_ranks")
@pytest.mark.parametrize("setting", list(OPTIMIZER_SETTINGS))
def test_optimizer_setting_that_differs_raises_on_every_rank(setting, monkeypatch):
    if setting == "HQ_MPI_EXCHANGE" and _differs():
        monkeypatch.setenv("HQ_MPI_EXCHANGE", "0")
    model = Linear(SHAPES)
    kw = {"compression": _compressor(), "fallback": "never",
          **OPTIMIZER_SETTINGS[setting](model, _differs())}
    opt = hqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), **kw)
    with pytest.raises(ValueError, match="differs between ranks") as excinfo:  # at its first step
        opt.zero_grad()
        model.loss(rank_gradients(SHAPES, 0, hvd.rank())).backward()
        opt.step()
    _same_error_everywhere(excinfo)


def _same_everywhere(t):
    everyone = hvd.allgather(t.detach().reshape(1, -1))
    return all(torch.equal(everyone[0], e) for e in everyone)


@pytest.mark.usefixtures("several_ranks")
@pytest.mark.parametrize("door", ["horovod", "quant"])
def test_backward_passes_per_step_may_differ(door):
    """Not a wire setting: a rank that accumulates its gradient over two backward passes starts
    the same exchanges, once its last pass is done, and the ranks stay identical."""
    passes = 2 if _differs() else 1
    model = Linear(SHAPES)
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    wrap = hqt.DistributedOptimizer if door == "quant" else hvd.DistributedOptimizer
    opt = wrap(base, named_parameters=model.named_parameters(), compression=_compressor(seed=5),
               backward_passes_per_step=passes,
               **({"fallback": "never"} if door == "quant" else {}))
    for step in range(2):
        opt.zero_grad()
        grads = rank_gradients(SHAPES, step, hvd.rank())
        for _ in range(passes):
            model.loss([g / passes for g in grads]).backward()
        opt.step()
    for p in model.ps:
        assert _same_everywhere(p.data) and torch.count_nonzero(p.data) > 0


#: setting of a horovod_quant compressor -> its arguments, whether this rank differs -> kwargs
COMPRESSOR_SETTINGS = {
    "codec params": lambda d: {"bits": 8 if d else 4},
    "seed": lambda d: {"seed": 2 if d else 1},
    "gather": lambda d: {"gather": "sra" if d else "allgather"},
    "policy": lambda d: {"policy": SAME_TENSORS if d else EVERYTHING},
    "HQ_MPI_EXCHANGE": lambda d: {"name": "global_qsgd"},
}


@pytest.mark.usefixtures("several_ranks")
@pytest.mark.parametrize("setting", list(COMPRESSOR_SETTINGS))
def test_compressor_setting_that_differs_raises_on_every_rank(setting, monkeypatch):
    """Through Horovod's DistributedOptimizer: at the first step's first decompress, before
    any exchange of the compressor starts."""
    if setting == "HQ_MPI_EXCHANGE" and _differs():
        monkeypatch.setenv("HQ_MPI_EXCHANGE", "0")
    model = Linear(SHAPES)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=_compressor(**COMPRESSOR_SETTINGS[setting](
                                       _differs())))
    opt.zero_grad()
    model.loss(rank_gradients(SHAPES, 0, hvd.rank())).backward()
    with pytest.raises(ValueError, match="differs between ranks") as excinfo:
        opt.step()
    opt._handles.clear()
    _same_error_everywhere(excinfo)
    assert not np.any([torch.count_nonzero(p.data).item() for p in model.ps])  # no update
