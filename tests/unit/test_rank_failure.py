"""A rank that dies in the middle of an exchange ends the whole job with an error, in bounded
time, under both launchers (their own failure handling), instead of leaving the others hanging
in the custom exponent allreduce or in Horovod's collectives."""
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("horovod.torch")

SCRIPT = textwrap.dedent("""
    import os, sys, numpy as np
    import horovod.torch as hvd
    import horovod_quant as hq
    from horovod_quant.exchange import Exchange
    from horovod_quant.torch.collectives import HorovodTorchCollectives
    hvd.init()
    codec = hq.get_codec("global_qsgd", world_size=hvd.size(), levels="exponential")
    ex = Exchange(codec, HorovodTorchCollectives())
    x = np.ones(1 << 16, np.float32)
    ex.start(x, 0, "warm").wait()
    if hvd.rank() == 1:
        os._exit(3)            # dies before the second exchange
    ex.start(x, 1, "second").wait()
    print("survivor finished", flush=True)
""")

#: horovodrun through tests/horovodrun.py: the same launch, its build probe importing torch
HOROVODRUN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "horovodrun.py")
LAUNCHERS = {
    "mpirun": ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "3"],
    "horovodrun-gloo": [sys.executable, HOROVODRUN, "-np", "3", "-H", "localhost:3", "--gloo"],
}


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_dead_rank_fails_the_job_in_bounded_time(launcher, tmp_path):
    cmd = LAUNCHERS[launcher]
    tool = launcher.split("-")[0]
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed")
    script = tmp_path / "die.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMPI_MCA_mpi_yield_when_idle="1",
               OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    proc = subprocess.run(cmd + [sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=240)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "survivor finished" not in proc.stdout
    assert elapsed < 180, f"the job took {elapsed:.0f}s to notice the dead rank"
