"""A job whose rank 0 runs one step more than the others (an uneven data loader), in one door:

    horovodrun -np 2 --gloo python3 tests/uneven_steps_job.py optimizer-gloo
    (or optimizer-horovod, optimizer-auto, compression, tensorflow)
    torchrun --nproc_per_node 2 tests/uneven_steps_job.py ddp

Each rank prints when it finished its steps (``rank R done at T``) or what it raised (``rank R
raised at T: ...``); with ``even`` as the second argument every rank runs the same steps.
tests/unit/test_uneven_steps.py launches it and checks that every rank reports the same error.
The TensorFlow job loads no torch (its ranks agree on the job's end without it): a rank that
finds torch loaded raises.
"""
import sys
import time

STEPS = 3


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _horovod(door: str):
    import horovod.torch as hvd
    import torch

    import horovod_quant.torch as hq

    hvd.init()
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    if door == "compression":
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       compression=hq.Compression.qsgd(bits=8))
    else:
        opt = hq.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                      compression=hq.Compression.qsgd(bits=8), fallback="never",
                                      transport=door.split("-")[1])
    return hvd.rank(), model, opt


def _ddp():
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from horovod_quant.torch import ddp

    dist.init_process_group("gloo")
    model = DistributedDataParallel(_model())
    model.register_comm_hook(ddp.QuantizationState("qsgd", fallback="never"),
                             ddp.quantization_hook)
    return dist.get_rank(), model, torch.optim.SGD(model.parameters(), lr=0.1)


def _tensorflow():
    """One tf.function step of a DistributedGradientTape with a horovod_quant compressor."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import horovod_quant.tensorflow as hqtf

    hvd.init()
    tf.random.set_seed(0)
    weights = tf.Variable(tf.random.normal([256, 64]))
    compression = hqtf.Compression.qsgd(bits=8)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.matmul(tf.random.normal([16, 256]), weights) ** 2)
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        weights.assign_sub(0.1 * tape.gradient(loss, [weights])[0])
    return hvd.rank(), step


def _torch_step(model, opt):
    import torch

    def step():
        opt.zero_grad()
        model(torch.randn(16, 32)).pow(2).mean().backward()
        opt.step()
    return step


def main() -> None:
    door = sys.argv[1]
    if door == "tensorflow":
        rank, step = _tensorflow()
    else:
        rank, model, opt = _ddp() if door == "ddp" else _horovod(door)
        step = _torch_step(model, opt)
    steps = STEPS + (1 if rank == 0 and sys.argv[2:] != ["even"] else 0)
    try:
        for _ in range(steps):
            step()
    except Exception as exc:
        print(f"rank {rank} raised at {time.time():.3f}: {type(exc).__name__}: {exc}",
              flush=True)
        raise
    if door == "tensorflow" and "torch" in sys.modules:
        raise RuntimeError("the TensorFlow job loaded torch")
    print(f"rank {rank} done at {time.time():.3f}", flush=True)


if __name__ == "__main__":
    main()
