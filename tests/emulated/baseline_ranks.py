"""One rank of tests/emulated/test_baseline_on_hosts.py: ``hq.torch.DistributedOptimizer`` with
qsgd of the bits given as the first argument and its default fallback (``baseline="auto"``) on
one 16 MB layer, trained past the fallback's trial and step check, timed for real on the
emulated link.

Prints one line ``RESULT <json>``: the baseline trial (the baseline chosen, each candidate's
seconds, the links' rates measured), each bucket's decision with both times, the step check,
the last step's stats, and a hash of the final weights.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys

import horovod.torch as hvd
import torch

import horovod_quant.torch as hqt
from horovod_quant.fallback import FALLBACK_STEP, STEP_CHECK_ROUNDS

#: past the trial and a whole step check
STEPS = FALLBACK_STEP + 2 * STEP_CHECK_ROUNDS + 2


def main() -> None:
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048)  # 4.2 M float32 gradients: one 16 MB bucket
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(),
                                   compression=hqt.Compression.qsgd(bits=int(sys.argv[1])))
    gen = torch.Generator().manual_seed(hvd.rank())
    for _ in range(STEPS):
        opt.zero_grad()
        model(torch.randn(8, 2048, generator=gen)).square().mean().backward()
        opt.step()
    check = opt.fallback_step_check
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    print("RESULT " + json.dumps({
        "rank": hvd.rank(), "baseline": dataclasses.asdict(opt.fallback_baseline),
        "decisions": [dataclasses.asdict(d) for d in opt.fallback_decisions],
        "step_check": None if check is None else dataclasses.asdict(check),
        "fabric": list(opt.fabric), "stats": str(opt.last_stats),
        "stats_baseline": opt.last_stats.baseline, "fallen_back": opt.last_stats.fallen_back,
        "weights_sha256": hashlib.sha256(weights.numpy().tobytes()).hexdigest()}), flush=True)


if __name__ == "__main__":
    main()
