"""Tensor names from Horovod's PyTorch call sites, on every frame layout.

Horovod 0.28.1 calls ``compress`` from a list comprehension in ``grouped_allreduce`` and in the
optimizer's grouped path. Before Python 3.12 the comprehension is a frame of its own; 3.12
inlines it into the function (PEP 709), so ``compress``'s caller is the function itself. The
call sites here are Horovod's own functions, compiled from the installed Horovod's source into
modules of Horovod's names (the layout of the Python running the tests), and the same calls
written as a plain loop in the function (3.12's layout on any Python) and from a nested
comprehension (two comprehension frames before 3.12).
"""
import ast
import importlib.util
import sys
from pathlib import Path

import pytest

from horovod_quant.torch.horovod_calls import horovod_call

OPTIMIZER, MPI_OPS = "horovod.torch.optimizer", "horovod.torch.mpi_ops"


class Tensor:
    """What the call sites touch of a tensor."""

    is_sparse = False

    def __init__(self, label):
        self.label = label
        self.grad = None

    def to_dense(self):
        return Tensor(self.label + ".dense")


class Param(Tensor):
    def __init__(self, label):
        super().__init__(label)
        self.grad = Tensor(label + ".grad")


class Recorder:
    """A compressor that records the name each call gives its tensor."""

    def __init__(self):
        self.names = []

    def compress(self, tensor):
        call = horovod_call()
        self.names.append((tensor.label, call.name(tensor) if call else None))
        return tensor, None

    def decompress(self, tensor, ctx):
        return tensor


class Subclassed(Recorder):
    """A compressor whose compress adds a frame between Horovod's call and ours."""

    def compress(self, tensor):
        return super().compress(tensor)


class _Apply:
    @staticmethod
    def apply(*args):
        return [a for a in args if isinstance(a, Tensor)]


STUBS = {"Average": 0, "Sum": 1, "allreduce_async_": lambda *a, **k: "handle",
         "grouped_allreduce_async_": lambda *a, **k: "handle",
         "HorovodAllreduce": type("A", (), {"apply": staticmethod(lambda t, *a: t)}),
         "HorovodGroupedAllreduce": _Apply, "global_process_set": None,
         "Compression": type("Compression", (), {"none": None})}


def _module(name, source, filename="<test>"):
    namespace = {"__name__": name, **STUBS}
    exec(compile(source, filename, "exec"), namespace)
    return namespace


def _horovod_functions():
    """Horovod's own call sites, compiled from the installed sources: the optimizer's two
    methods (as functions taking ``self``) and mpi_ops' allreduce and grouped_allreduce."""
    spec = importlib.util.find_spec("horovod")
    if spec is None or spec.origin is None:
        pytest.skip("Horovod is not installed")
    root = Path(spec.origin).parent / "torch"
    found = {}
    for module, file, wanted in ((OPTIMIZER, "optimizer.py",
                                  ("_allreduce_grad_async", "_grouped_allreduce_grad_async")),
                                 (MPI_OPS, "mpi_ops.py", ("allreduce", "grouped_allreduce"))):
        tree = ast.parse((root / file).read_text())
        nodes = list(tree.body)
        if module == OPTIMIZER:  # the methods of the plain optimizer class
            nodes = next(n for n in tree.body if isinstance(n, ast.ClassDef)
                         and n.name == "_DistributedOptimizer").body
        defs = [n for n in nodes if isinstance(n, ast.FunctionDef) and n.name in wanted]
        assert sorted(d.name for d in defs) == sorted(wanted), file
        namespace = _module(module, ast.unparse(ast.Module(body=defs, type_ignores=[])),
                            str(root / file))
        found.update({(module, w): namespace[w] for w in wanted})
    return found


#: the same call sites as 3.12 runs them: compress called from the function's own frame, and
#: from nested comprehensions (two comprehension frames on Python < 3.12)
LOOPS = '''
def _grouped_allreduce_grad_async(self, ps):
    name = self._parameter_names.get(ps[0])
    out = []
    for p in ps:
        out.append(self._compression.compress(p.grad))
    return "handle", [c for _, c in out]

def _allreduce_grad_async(self, p):
    tensor = p.grad
    if tensor.is_sparse and self.sparse_as_dense:
        tensor = tensor.to_dense()
    return self._compression.compress(tensor)
'''
LOOPS_MPI = '''
def grouped_allreduce(tensors, average=None, name=None, compression=None):
    out = []
    for t in tensors:
        out.append(compression.compress(t))
    return out

def allreduce(tensor, average=None, name=None, compression=None):
    return compression.compress(tensor)
'''
NESTED = '''
def _grouped_allreduce_grad_async(self, ps):
    return [[self._compression.compress(q.grad) for q in [p]] for p in ps]

def _allreduce_grad_async(self, p):
    tensor = p.grad
    if tensor.is_sparse and self.sparse_as_dense:
        tensor = tensor.to_dense()
    return [self._compression.compress(t) for t in [tensor]]
'''
NESTED_MPI = '''
def grouped_allreduce(tensors, average=None, name=None, compression=None):
    return [[compression.compress(u) for u in [t]] for t in tensors]

def allreduce(tensor, average=None, name=None, compression=None):
    return [compression.compress(t) for t in [tensor]]
'''


def _written(optimizer_source, mpi_source):
    opt, mpi = _module(OPTIMIZER, optimizer_source), _module(MPI_OPS, mpi_source)
    return {(OPTIMIZER, "_allreduce_grad_async"): opt["_allreduce_grad_async"],
            (OPTIMIZER, "_grouped_allreduce_grad_async"): opt["_grouped_allreduce_grad_async"],
            (MPI_OPS, "allreduce"): mpi["allreduce"],
            (MPI_OPS, "grouped_allreduce"): mpi["grouped_allreduce"]}


LAYOUTS = {
    f"horovod-as-installed-py{sys.version_info.major}.{sys.version_info.minor}":
        _horovod_functions,
    "plain-loop-as-py3.12": lambda: _written(LOOPS, LOOPS_MPI),
    "nested-comprehensions": lambda: _written(NESTED, NESTED_MPI),
}


class FakeOptimizer:
    """The attributes of Horovod's optimizer that its call sites read."""

    def __init__(self, params, compression, sparse_as_dense=False):
        self._parameter_names = {p: f"layer{i}.weight" for i, p in enumerate(params)}
        self._compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.op, self.gradient_predivide_factor, self.process_set = 0, 1.0, None


@pytest.fixture(params=list(LAYOUTS))
def sites(request):
    return LAYOUTS[request.param]()


@pytest.mark.parametrize("compressor", [Recorder, Subclassed])
def test_grouped_optimizer_names_each_parameter(sites, compressor):
    params = [Param(f"p{i}") for i in range(3)]
    opt = FakeOptimizer(params, compressor())
    sites[OPTIMIZER, "_grouped_allreduce_grad_async"](opt, params)
    assert opt._compression.names == [(f"p{i}.grad", f"layer{i}.weight") for i in range(3)]


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_optimizer_names_its_parameter(sites, sparse_as_dense):
    params = [Param("p0"), Param("p1")]
    params[1].grad.is_sparse = sparse_as_dense  # Horovod densifies sparse gradients only
    opt = FakeOptimizer(params, Recorder(), sparse_as_dense)
    sites[OPTIMIZER, "_allreduce_grad_async"](opt, params[1])
    label = "p1.grad.dense" if sparse_as_dense else "p1.grad"
    assert opt._compression.names == [(label, "layer1.weight")]


def test_grouped_allreduce_names_by_index(sites):
    comp = Recorder()
    tensors = [Tensor("a"), Tensor("b"), Tensor("c")]
    sites[MPI_OPS, "grouped_allreduce"](tensors, name="grads", compression=comp)
    assert comp.names == [("a", "grads[0]"), ("b", "grads[1]"), ("c", "grads[2]")]


def test_unnamed_calls_give_none(sites):
    comp = Recorder()
    sites[MPI_OPS, "grouped_allreduce"]([Tensor("a")], compression=comp)
    sites[MPI_OPS, "allreduce"](Tensor("b"), compression=comp)
    sites[MPI_OPS, "allreduce"](Tensor("c"), name="c.name", compression=comp)
    assert comp.names == [("a", None), ("b", None), ("c", "c.name")]


def test_outside_horovod_there_is_no_call():
    comp = Recorder()
    comp.compress(Tensor("x"))
    assert comp.names == [("x", None)]


def test_only_horovods_modules_count():
    """A function of Horovod's name in another module is no call site."""
    other = _module("mine", LOOPS_MPI)
    comp = Recorder()
    other["allreduce"](Tensor("x"), name="x", compression=comp)
    assert comp.names == [("x", None)]

