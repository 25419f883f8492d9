# hf2q-py: `make demo` sets up and generates with the built-in model; `make test` sets up and runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint bench

$(BIN)/hf2q-py: pyproject.toml tests/agents/package-lock.json
	./scripts/setup.sh "$(PY)" "$(VENV)"

setup: $(BIN)/hf2q-py

demo: setup
	$(BIN)/hf2q-py generate --method ngram --max-tokens 200 --prompt-file examples/prompts/type_hints.txt

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/hf2q-py bench --methods ngram --max-tokens 256
