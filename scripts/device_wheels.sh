#!/usr/bin/env bash
# Wheels the lent GPU machine lacks (its image has torch, triton, transformers, pytest, ...; no
# server stack, grammar engine, GGUF reader or pytest-asyncio), at the versions this checkout's
# .venv holds, for CPython 3.12 on x86-64 Linux, into .whl/ (git-ignored; carry it). On the
# machine, before the tests:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD/engine:$PWD/tests:$PWD/bench:$PWD/node_agent:$PWD/operator
#   python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS="fastapi starlette uvicorn pydantic pydantic_core annotated-types typing-inspection annotated-doc
      llguidance gguf pytest-asyncio"
mkdir -p .whl
for pkg in $PKGS; do
  version=$(.venv/bin/pip show "$pkg" 2>/dev/null | awk '/^Version:/{print $2}')
  [ -n "$version" ] || { echo "device_wheels: $pkg is not in .venv (run scripts/install.sh first)" >&2; exit 1; }
  ls .whl | grep -qi "^${pkg//-/_}-${version}-" && continue
  found=0
  for platform in manylinux2014_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 any; do
    if python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
         --platform "$platform" -d .whl "$pkg==$version" >/dev/null 2>&1; then found=1; break; fi
  done
  [ "$found" = 1 ] || { echo "device_wheels: no CPython 3.12 x86-64 wheel of $pkg $version" >&2; exit 1; }
done
du -sh .whl
