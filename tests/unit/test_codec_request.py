"""``Compression.<name>(...)`` before Horovod is initialized: world-sized codecs wait for a
world size (the DDP door gives its process group's), the others are built and validated at
once. Runs in a child process, so that no Horovod is initialized there."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r'''
import horovod.torch as hvd
import horovod_quant.torch as hqt

assert not hvd.is_initialized()
comp = hqt.Compression.global_qsgd(bits=8, seed=3)
assert comp.codec_request.name == "global_qsgd" and comp.codec_request.needs_world_size
assert comp.codec_request.build(lambda: 4).params["world_size"] == 4
try:
    comp.codec  # still no Horovod: its size is not known
except ValueError as exc:
    assert "not been initialized" in str(exc), exc
else:
    raise AssertionError("a world-sized codec was built without a world size")
fixed = hqt.Compression.global_qsgd(bits=8, world_size=3)
assert fixed.codec.params["world_size"] == 3 and not fixed.codec_request.needs_world_size
assert hqt.Compression.qsgd(bits=4).codec.params["bits"] == 4
try:
    hqt.Compression.qsgd(bits=99)
except ValueError:
    pass
else:
    raise AssertionError("invalid parameters of a codec that needs no world size passed")
print("ok")
'''


def test_compression_before_horovod_init():
    res = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300,
                         check=False)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]
