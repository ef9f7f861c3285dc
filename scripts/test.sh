#!/usr/bin/env bash
# Install everything the tests need and run the whole suite.
#   .venv     the project with its test extras
#   .venv-tf  tensorflow-cpu==2.21.0, used only as an oracle by the tests; with transformers and a CPU torch
#             for the BERT conversion test (transformers' own TF loader is the reference)
# Extra arguments go to pytest. Any failure (including "no tests ran") fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[test]"

if ! .venv-tf/bin/python -c "import tensorflow" >/dev/null 2>&1; then
  rm -rf .venv-tf
  "$PY" -m venv .venv-tf
  .venv-tf/bin/python -m pip install -q tensorflow-cpu==2.21.0
fi
if ! .venv-tf/bin/python -c "import transformers, torch" >/dev/null 2>&1; then
  # the same torch pin as the [test] extra of .venv (this machine's pip resolves it to the CPU wheel)
  .venv-tf/bin/python -m pip install -q torch==2.13.0 transformers==4.57.6 "safetensors>=0.4"
fi
export SHARDCKPT_TF_PYTHON="$PWD/.venv-tf/bin/python"

# The checks the code is written to: lint and types of the package.
.venv/bin/ruff check src tests
.venv/bin/mypy

exec .venv/bin/python -m pytest "$@"
