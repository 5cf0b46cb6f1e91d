"""``horovodrun`` for the test runners, its build probe asking ``horovod.torch`` first.

Before launching, horovodrun checks that Horovod was built with gloo (or MPI) by importing one
of Horovod's framework extensions in a forked process, TensorFlow's first: with TensorFlow
installed, that import is most of a launch's 8 s on a 2-core machine. Every extension of one
build gives the same answer, and torch imports in less than half the time. The rest is
horovodrun's own code: same arguments, same launch.

    python3 tests/horovodrun.py -np 2 -H localhost:2 --gloo python3 -m pytest tests/parallel
"""
import sys

from horovod.common import util

util.EXTENSIONS.sort(key=lambda name: name != "torch")

from horovod.runner.launch import run_commandline  # noqa: E402

if __name__ == "__main__":
    sys.argv[0] = "horovodrun"
    sys.exit(run_commandline())
