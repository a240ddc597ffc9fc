# `make demo` and `make test` set everything up on a fresh machine, then run.
# torch is pinned and installed before the project so pip never resolves a newer
# (CUDA, several GB) build.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test install clean gpu-check gpu-native

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]' $(TORCH)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_under_budget.py --steps 10
	$(VENV)/bin/hyperoffload inspect --workload tiny-llama --mode train --verify
	$(VENV)/bin/hyperoffload plan --workload tiny-llama --mode train --hardware h100-sxm --budget 50%
	$(VENV)/bin/hyperoffload run --workload tiny-llama --mode train --budget 50% --link 500MB/s

# The GPU tests (tests/gpu: the CUDA runtime), planned LLaMA steps with the CUDA runtime against the unplanned step and the
# simulator, then every training policy run for real (needs a GPU; says so and exits 0 without one). The virtual environment
# holds PyTorch's CPU build, so this runs the project from src/ with a Python that has a CUDA build of
# PyTorch: GPU_PYTHON (default python3; torch 2.11.0+cu130 and 2.13.0 are known to work).
GPU_PYTHON ?= python3
gpu-check:
	@$(GPU_PYTHON) -c "import torch" 2>/dev/null || { echo "gpu-check: $(GPU_PYTHON) has no PyTorch; set GPU_PYTHON to a Python with a CUDA build of PyTorch (make gpu-check GPU_PYTHON=/path/to/python)"; exit 2; }
	PYTHONPATH=src $(GPU_PYTHON) -m pytest -q -p no:cacheprovider tests/gpu; tests=$$?; \
	PYTHONPATH=src $(GPU_PYTHON) bench/gpu_check.py; status=$$?; \
	PYTHONPATH=src $(GPU_PYTHON) bench/gpu_compare.py && [ $$tests -eq 0 ] && exit $$status

# train_step beside PyTorch's own offloading (functorch activation offloading, save_on_cpu, FSDP2 CPUOffloadPolicy,
# torchao's CPUOffloadOptimizer) and no offload, on a bf16 LLaMA of about 1B parameters on the GPU; the JSON goes to
# $OUT (or results/) as gpu_native.json. Needs a GPU and the same GPU_PYTHON as gpu-check.
gpu-native:
	@$(GPU_PYTHON) -c "import torch" 2>/dev/null || { echo "gpu-native: $(GPU_PYTHON) has no PyTorch; set GPU_PYTHON to a Python with a CUDA build of PyTorch"; exit 2; }
	PYTHONPATH=src $(GPU_PYTHON) bench/gpu_native.py --json $${OUT:-results}/gpu_native.json

test: $(STAMP)
	$(PY) -m pytest -q -n 2

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis
