"""The DDP hook's BucketPipeline: buckets run on a worker in a fixed order (start of bucket
i + 1 before the finish of bucket i), the hook's call returns before the bucket's exchange is
done, and a failing bucket fails its own future only."""
import threading

import pytest
import torch

from horovod_quant.torch.ddp import BucketPipeline


def _bucket(events, i, gate=None, fail_at=None):
    """A bucket's start: records ``start i`` (after ``gate`` opens), returns its finish, which
    records ``finish i`` and returns a tensor of i; ``fail_at`` ("start"/"finish") raises."""
    def start():
        if gate is not None:
            gate.wait(10)
        events.append(f"start {i}")
        if fail_at == "start":
            raise ValueError(f"bucket {i} failed to start")

        def finish():
            events.append(f"finish {i}")
            if fail_at == "finish":
                raise ValueError(f"bucket {i} failed to finish")
            return torch.full((2,), float(i))

        return finish
    return start


def test_buckets_run_in_one_order_and_the_hook_does_not_wait():
    pipeline, events, gate = BucketPipeline("test.pipeline"), [], threading.Event()
    futures = [pipeline.submit(_bucket(events, 0, gate), last=False)]
    assert not futures[0].done()  # the worker waits for the gate: the hook returned
    futures += [pipeline.submit(_bucket(events, i), last=i == 2) for i in (1, 2)]
    gate.set()
    values = [f.wait() for f in futures]
    assert [v[0].item() for v in values] == [0.0, 1.0, 2.0]
    assert events == ["start 0", "start 1", "finish 0", "start 2", "finish 1", "finish 2"]
    # the next step begins anew
    events.clear()
    assert pipeline.submit(_bucket(events, 0), last=True).wait()[0].item() == 0.0
    assert events == ["start 0", "finish 0"]


@pytest.mark.parametrize("fail_at", ["start", "finish"])
def test_a_failing_bucket_fails_its_own_future(fail_at):
    pipeline, events = BucketPipeline("test.pipeline"), []
    futures = [pipeline.submit(_bucket(events, i, fail_at=fail_at if i == 1 else None),
                               last=i == 2) for i in range(3)]
    assert futures[0].wait()[0].item() == 0.0 and futures[2].wait()[0].item() == 2.0
    with pytest.raises(ValueError, match=f"bucket 1 failed to {fail_at}"):
        futures[1].wait()
