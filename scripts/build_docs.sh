#!/usr/bin/env bash
# Build the API reference (HTML) from the docstrings with pdoc.
#
#   bash scripts/build_docs.sh [OUTPUT_DIR]      (default: build/docs)
#
# The package and every public submodule are rendered (pdoc walks them; modules whose
# names start with an underscore are private and left out); docs/*.md are copied beside.
# Every Python warning raised while importing and rendering is an error (exit 1), so a
# broken docstring reference or an import problem fails the build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/build/docs}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON="$(command -v python3)"
rm -rf "$OUT"
mkdir -p "$OUT"
PYTHONWARNINGS=error "$PYTHON" -m pdoc --docformat restructuredtext --no-show-source \
    --footer-text "shardckpt API reference" -o "$OUT" \
    shardckpt shardckpt.dtensor shardckpt.distributed shardckpt.storage shardckpt.restoring shardckpt.torch shardckpt.jax \
    shardckpt.convert
cp "$ROOT"/docs/*.md "$OUT"/ 2>/dev/null || true
echo "API reference written to $OUT/index.html"
