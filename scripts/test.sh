#!/usr/bin/env bash
# Install everything the tests need and run the whole suite.
#   .venv     the project with its test extras
#   .venv-tf  tensorflow-cpu==2.21.0, used only as an oracle by the tests; with transformers and a CPU torch
#             for the BERT conversion test (transformers' own TF loader is the reference)
# Extra arguments go to pytest. Any failure (including "no tests ran") fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
START=$SECONDS
step() { echo "[scripts/test.sh +$((SECONDS - START))s] $*" >&2; }

# torch is installed on its own first: asked for alone, `torch==2.13.0` takes the CPU wheel where the
# registry serves one (this machine's /opt/wheels); resolved together with the whole [test] extra, pip's
# backtracking over s3fs/aiobotocore/boto3 falls back to the 5 GB CUDA build. Once installed, it is kept.
if [ ! -x .venv/bin/python ]; then step "creating .venv"; "$PY" -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
step "installing torch==2.13.0 into .venv (CPU wheel where available; about 1 min)"
.venv/bin/python -m pip install -q torch==2.13.0
step "installing shardckpt with its [test] extra into .venv (jax, orbax, MPI, moto, ...; a few minutes)"
.venv/bin/python -m pip install -q -e ".[test]"

if ! .venv-tf/bin/python -c "import tensorflow" >/dev/null 2>&1; then
  rm -rf .venv-tf
  step "creating .venv-tf with tensorflow-cpu==2.21.0 (the oracle; about 1 min)"
  "$PY" -m venv .venv-tf
  .venv-tf/bin/python -m pip install -q tensorflow-cpu==2.21.0
fi
if ! .venv-tf/bin/python -c "import transformers, torch" >/dev/null 2>&1; then
  # the same torch pin as the [test] extra of .venv, installed alone first for the same reason
  step "installing torch, transformers==4.57.6 and safetensors into .venv-tf (the BERT conversion oracle)"
  .venv-tf/bin/python -m pip install -q torch==2.13.0
  .venv-tf/bin/python -m pip install -q transformers==4.57.6 "safetensors>=0.4"
fi
step "environments ready: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)') in .venv"
export SHARDCKPT_TF_PYTHON="$PWD/.venv-tf/bin/python"

# The checks the code is written to: lint and types of the package.
step "ruff and mypy"
.venv/bin/ruff check src tests
.venv/bin/mypy
step "pytest"

exec .venv/bin/python -m pytest "$@"
