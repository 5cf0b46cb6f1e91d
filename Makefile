# Entry points for developers and CI (.ci/run calls `make test`).
# scripts/install.sh is idempotent: after the first run it only checks and skips (a few seconds).
PYTHON ?= python3
export PYTHON

.PHONY: all install test lint unit parallel emulated kernels demo bench clean clean-cache \
	images image-test image-test-gpu image-two-hosts gpu-check gpu-check-inputs wheel

all: test

install:
	bash scripts/install.sh

# pytest loads only the plugins named (-p): hypothesis's, loaded by itself, takes 2.7 s in every
# pytest process; only tests/unit uses it (the multi-rank runners set the same variable)
NO_PLUGINS = PYTEST_DISABLE_PLUGIN_AUTOLOAD=1

# The linter runs first (ruff, pinned and installed by the install step). Every suite fails when
# it collects no test (pytest's exit status 5; tests/unit/test_suites.py holds the rule): one
# folder per pytest run, so that each must collect its own. A suite whose tests all skip passes
# (tests/gpu without a GPU).
test: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q -n auto tests/unit
	$(PYTHON) scripts/check_docs.py
	bash scripts/check_wheel.sh
	bash tests/parallel/run.sh
	bash tests/parallel_tf/run.sh
	bash tests/parallel_ddp/run.sh
	bash tests/emulated/run.sh
	bash tests/cuda_parity/compile.sh
	$(NO_PLUGINS) $(PYTHON) -m pytest -p xdist.plugin -q -n auto tests/cuda_parity
	$(NO_PLUGINS) $(PYTHON) -m pytest -q tests/gpu

# The linter over the whole tree (pyproject.toml's [tool.ruff]), the first step of `test`.
lint:
	$(PYTHON) -m ruff check .

# The release as a user installs it: sdist and wheel built, the wheel alone in a fresh virtual
# environment (scripts/check_wheel.sh; part of `test`).
wheel:
	bash scripts/check_wheel.sh

# The pieces of `test` on their own, without the install step.
unit:
	$(PYTHON) -m pytest -q -n auto tests/unit

parallel:
	bash tests/parallel/run.sh
	bash tests/parallel_tf/run.sh
	bash tests/parallel_ddp/run.sh

# jobs on emulated hosts (network namespaces): root and iproute2 needed
emulated:
	bash tests/emulated/run.sh

kernels:
	bash tests/cuda_parity/compile.sh

# The main job: every codec on real gradients (bits, variance vs bound, throughput), then a
# 2-rank horovodrun training of an MLP on digits once per codec plus fp32/fp16 baselines, and
# the same MLP under torchrun with DDP and the horovod_quant comm hook.
demo: install
	$(PYTHON) -m horovod_quant.demo
	mkdir -p bench_out
	OMP_NUM_THREADS=1 horovodrun -np 2 -H localhost:2 --gloo \
	  $(PYTHON) examples/pytorch_digits.py --json bench_out/demo_training.json
	OMP_NUM_THREADS=1 $(PYTHON) -m torch.distributed.run --standalone --nproc_per_node 2 \
	  examples/ddp_train.py --json bench_out/demo_ddp.json

# Docker images (docker/README.md): built with docker, podman or buildah, whichever is present;
# IMAGES_ARGS passes options to scripts/build_images.py (e.g. --no-tensorflow, --images cpu,gpu).
images:
	$(PYTHON) scripts/build_images.py $(IMAGES_ARGS)

# Inside a container of the CPU image: the demo's parts and the multi-rank tests. torchrun's
# rendezvous needs the container's own name to resolve (buildah run does not add it; docker does),
# so it goes to /etc/hosts after the Horovod runs, which must work without it.
image-test:
	bash scripts/image_run.sh horovod_quant:cpu 'python3 -m horovod_quant.demo && \
	  horovodrun -np 2 -H localhost:2 --gloo python3 examples/pytorch_digits.py && \
	  bash tests/parallel/run.sh && \
	  { getent hosts "$$(hostname)" >/dev/null || echo "127.0.0.1 $$(hostname)" >> /etc/hosts; } && \
	  python3 -m torch.distributed.run --standalone --nproc_per_node 2 examples/ddp_train.py'

# Inside a container of the GPU image, on a machine without a GPU: the build's checks
# (scripts/gpu_image_check.py: torch, CuPy and nvcc of one CUDA, Horovod with NCCL, gloo and MPI,
# the kernels compiled with NVRTC for sm_80 and sm_90), then a 2-rank CPU training with a codec
# under horovodrun's gloo and MPI. On a GPU host, `make gpu-check` inside the container runs
# what needs the GPU.
image-test-gpu:
	bash scripts/image_run.sh horovod_quant:gpu 'python3 scripts/gpu_image_check.py && \
	  horovodrun -np 2 -H localhost:2 --gloo \
	    python3 tests/parallel/compressed_training.py --codec qsgd && \
	  horovodrun -np 2 -H localhost:2 --mpi \
	    python3 tests/parallel/compressed_training.py --codec qsgd'

# Two containers of the CPU image as two hosts on an emulated network, horovodrun across them
# (root and buildah needed).
image-two-hosts:
	$(PYTHON) scripts/image_two_hosts.py

bench:
	$(PYTHON) benchmarks/codec_throughput.py

# Every check that needs a GPU, on a machine with one GPU and no network, from a copy of the
# working tree (no install step: it builds the Horovod it needs from vendor/'s sdist).
# GPU_CHECK_OUT: the output folder. Before copying, with network: make gpu-check-inputs.
gpu-check:
	bash scripts/gpu_check.sh $(GPU_CHECK_ARGS)

# The Horovod sdist into vendor/ (ignored by git; the copy for the GPU machine carries it):
# from scripts/install.sh's cache, else from PyPI.
HOROVOD_VERSION ?= 0.28.1
gpu-check-inputs:
	mkdir -p vendor
	cp "$${HQ_CACHE:-$$HOME/.cache/horovod_quant}/src/horovod-$(HOROVOD_VERSION).tar.gz" vendor/ \
	  2>/dev/null || $(PYTHON) -m pip download -q --no-binary :all: --no-deps -d vendor \
	  horovod==$(HOROVOD_VERSION)
	ls -l vendor/horovod-$(HOROVOD_VERSION).tar.gz

clean:
	rm -rf build dist .eggs *.egg-info bench_out .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	find . \( -name '*.py[co]' -o -name '*.nbi' -o -name '*.nbc' \) -type f -delete

# Drops the cached Horovod wheels and sources: the next `make install` rebuilds Horovod.
clean-cache:
	rm -rf "$${HQ_CACHE:-$$HOME/.cache/horovod_quant}"
