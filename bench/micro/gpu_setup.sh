# Sourced by the GPU scripts: make mox importable with the GPU machine's own python3 (torch,
# triton, tokenizers are there; no network). Carried wheels in .whl/ (msgspec) install first.
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3 \
    || ! python3 -c "import mox.kernels, mox.bench"; then
  # fallback without pip: map mox.kernels -> kernels/, mox.bench -> bench/ at start-up
  mkdir -p /tmp/mox_shim
  printf 'import sys\nsys.path.insert(0, "%s")\nimport mox\nmox.__path__.append("%s")\n' \
      "$PWD" "$PWD" > /tmp/mox_shim/sitecustomize.py
  export PYTHONPATH=/tmp/mox_shim${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import mox.kernels, triton, torch; print('mox ok; triton', triton.__version__, 'torch', torch.__version__)"
