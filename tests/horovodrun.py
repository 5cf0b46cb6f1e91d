"""``horovodrun`` for the test runners, its build probe asking ``horovod.torch`` first, once.

Before launching, horovodrun checks that Horovod was built with gloo (or MPI) by importing one
of Horovod's framework extensions in a forked process, TensorFlow's first: with TensorFlow
installed, that import is most of a launch's 8 s on a 2-core machine. Every extension of one
build gives the same answer, and torch imports in less than half the time. The answers are kept
in a file named after the installed extensions' size and time (a rebuilt Horovod asks again), so
the test runs' dozen launches probe once: each probe took 3 s on a core while the other idled.
The rest is horovodrun's own code: same arguments, same launch.

    python3 tests/horovodrun.py -np 2 -H localhost:2 --gloo python3 -m pytest tests/parallel
"""
import glob
import hashlib
import json
import os
import sys
import tempfile

from horovod.common import util

util.EXTENSIONS.sort(key=lambda name: name != "torch")


def _answers_file() -> str:
    package = os.path.dirname(os.path.dirname(util.__file__))
    build = sorted((path, os.stat(path).st_size, os.stat(path).st_mtime_ns)
                   for path in glob.glob(os.path.join(package, "*", "mpi_lib*.so")))
    key = hashlib.sha256(repr((sys.executable, build)).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"hq-horovod-build-probe-{key}.json")


def _probe_once(probe):
    """``probe`` (Horovod's forked import of an extension), its answers kept in a file."""
    path = _answers_file()

    def remembered(ext_base_name, fn, fn_desc, verbose):
        try:
            with open(path, encoding="utf-8") as fh:
                answers = json.load(fh)
        except (OSError, ValueError):
            answers = {}
        key = f"{ext_base_name}: {fn_desc}"
        if key in answers:
            return answers[key]
        answers[key] = probe(ext_base_name, fn, fn_desc, verbose)
        if answers[key] is not None:  # None: the import failed, which the next launch retries
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(answers, fh)
            os.replace(tmp, path)  # launches running side by side never read half a file
        return answers[key]

    return remembered


util._check_extension_lambda = _probe_once(util._check_extension_lambda)

from horovod.runner.launch import run_commandline  # noqa: E402

if __name__ == "__main__":
    sys.argv[0] = "horovodrun"
    sys.exit(run_commandline())
