"""Packaging for horovod_quant.

The CUDA sources live in the top-level ``kernels/`` folder of the repository and are shipped inside
the installed package as ``horovod_quant/kernels/*.cu`` / ``*.cuh``: ``package_dir`` maps the
package ``horovod_quant.kernels`` to the folder ``kernels``, so both ``pip install .`` and the
editable install (``pip install -e .``) expose them to
``importlib.resources.files("horovod_quant.kernels")``.

Horovod is deliberately not a dependency: it has to be built from source against the installed
torch / TensorFlow (scripts/install.sh does that). The ``torch`` extra only asks for torch>=2.0;
install a CPU or CUDA build of torch yourself first so that pip does not pick one for you.

There is no TensorFlow extra: the TensorFlow door uses the TensorFlow Horovod was built against,
and the Keras door's tf-keras requires the package ``tensorflow`` (a second, full TensorFlow next
to tensorflow-cpu, or another version under a built Horovod). docs/tensorflow.md gives the one
``pip install --no-deps`` line for it.
"""
import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def read_version():
    with open(os.path.join(HERE, "horovod_quant", "__init__.py"), encoding="utf-8") as f:
        for line in f:
            if line.startswith("__version__"):
                return line.split("=", 1)[1].strip().strip("\"'")
    raise RuntimeError("no __version__ line in horovod_quant/__init__.py")


def read_long_description():
    path = os.path.join(HERE, "README.md")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    return ""


# what the examples import beyond the package: torch, and scikit-learn for the digits data set
EXAMPLES = ["torch>=2.0", "scikit-learn"]
TEST = ["pytest", "scikit-learn", "hypothesis"]

setup(
    name="horovod_quant",
    version=read_version(),
    description="Unbiased gradient quantizers (QSGD, NUQSGD, natural compression, dithering) "
                "as a Horovod compression plugin",
    long_description=read_long_description(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    # 3.11: the Python tested (DEVELOPERS.md, "Versions tested"; numpy 2.4 needs it). No upper
    # bound: numba, torch and TensorFlow ship wheels for 3.12+, and what 3.12 changed (inlined
    # comprehensions) was checked on 3.13; Horovod is built by scripts/install.sh, not required
    python_requires=">=3.11",
    packages=(find_packages(include=["horovod_quant", "horovod_quant.*"])
              + ["horovod_quant.kernels"]),
    package_dir={"horovod_quant.kernels": "kernels"},
    package_data={"horovod_quant.kernels": ["*.cu", "*.cuh"]},
    include_package_data=False,
    zip_safe=False,
    install_requires=["numpy", "numba"],
    extras_require={
        "torch": ["torch>=2.0"],
        "mpi": ["mpi4py"],
        # CuPy for the CUDA major of your torch:
        #   python -c "import torch; print(torch.version.cuda)"
        "gpu-cuda12": ["cupy-cuda12x"],
        "gpu-cuda13": ["cupy-cuda13x"],
        "examples": EXAMPLES,
        "test": TEST,
        "dev": TEST + ["ruff", "matplotlib", "tqdm"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.11",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
