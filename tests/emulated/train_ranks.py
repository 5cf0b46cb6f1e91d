"""One rank of tests/emulated: a small MLP trained for a few steps by
``hq.torch.DistributedOptimizer`` with its defaults, as a user would write it.

Prints one line ``RESULT <json>``: the optimizer's transport, the seconds from building the
optimizer to the end of the first step, what the ``horovod_quant`` logger (and Python's
warnings from the package) said in that time, and a hash of the final weights.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
import warnings

import horovod.torch as hvd
import torch

import horovod_quant.torch as hqt

STEPS = 3


class Recorder(logging.Handler):
    """Keeps the WARNING-or-worse records of the logger it is attached to."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main() -> None:
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    recorder = Recorder()
    logging.getLogger("horovod_quant").addHandler(recorder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        opt = hqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression=hqt.Compression.qsgd())
        build_s = time.monotonic() - t0
        gen = torch.Generator().manual_seed(hvd.rank())
        for step in range(STEPS):
            x = torch.randn(32, 64, generator=gen)
            y = torch.randint(0, 10, (32,), generator=gen)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if step == 0:
                first_step_s = time.monotonic() - t0
                # what later steps log is the fallback's speed decision for this tiny model
                # (no codec saves 2 ms here), not what the tests look at
                window = recorder.messages + [str(w.message) for w in caught
                                              if "horovod_quant" in (w.filename or "")
                                              or str(w.message).startswith("horovod_quant")]
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    print("RESULT " + json.dumps({
        "rank": hvd.rank(), "transport": opt.transport, "build_s": build_s,
        "first_step_s": first_step_s, "warnings": window,
        "weights_sha256": hashlib.sha256(weights.numpy().tobytes()).hexdigest()}), flush=True)


if __name__ == "__main__":
    main()
