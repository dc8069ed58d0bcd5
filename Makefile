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

# The layering contracts in pyproject.toml. import-linter finds a package's modules on disk,
# and mox.kernels, mox.loaders and mox.bench live outside mox/ (setuptools package-dir), so it
# checks an installed copy of the tree (~2 s).
IMPORT_LAYOUT := build/import-layout
lint-imports: $(STAMP)
	rm -rf $(IMPORT_LAYOUT)
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps \
		--no-build-isolation --no-compile --target $(IMPORT_LAYOUT) .
	cd $(IMPORT_LAYOUT) && $(CURDIR)/$(VENV)/bin/lint-imports --no-cache \
		--config $(CURDIR)/pyproject.toml
