# The two commands of the README: `make demo` and `make test`. Each sets itself up from a bare
# clone (a .venv with the CPU build of torch and mox installed editable), idempotently.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-stamp
# The CPU wheel of torch: a plain `torch` requirement with no torch present pulls a
# multi-GB CUDA build. GPU users install mox with `pip install -e .` over their own torch.
TORCH_CPU := torch==2.13.0

.PHONY: demo test setup lint-imports

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check $(TORCH_CPU)
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check -e '.[test,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mox generate --demo "Hello"

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(MAKE) --no-print-directory lint-imports
	$(VENV)/bin/python -m pytest -q

# The layering contracts in pyproject.toml. kernels/, loaders/ and bench/ sit at the root
# (setuptools package-dir maps them to mox.kernels, mox.loaders, mox.bench); the symlinks
# mox/kernels, mox/loaders and mox/bench show import-linter, which walks mox/ on disk, the
# same tree Python imports.
lint-imports: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache
