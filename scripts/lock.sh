#!/usr/bin/env bash
# lock.sh: regenerate requirements.lock from pyproject.toml (run it after changing a dependency).
#
# The lock pins, by version and sha256, every package of the shared venv that scripts/setup.sh makes:
# the dependencies, the extras llama, serve and dev, and the group `setup` (pip, setuptools), resolved for
# CPython 3.11 (requires-python's floor) on Linux x86_64. llama-cpp-python itself stays out: set-up builds
# its wheel from the pinned sdist, and the wheel's bytes differ from build to build; its own dependencies
# are in the lock. tests/project/test_lock.py checks that the lock still matches pyproject.toml.
#
# uv resolves it, from a pinned release installed into a temporary venv (never into the project's).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
UV_VERSION=0.13.9
PYTHON=${PYTHON:-python3}

tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
"$PYTHON" -m venv "$tools/venv"
"$tools/venv/bin/pip" install -q --disable-pip-version-check "uv==$UV_VERSION"

cd "$ROOT"
"$tools/venv/bin/uv" pip compile pyproject.toml \
  --extra llama --extra serve --extra dev --group setup \
  --no-emit-package llama-cpp-python \
  --generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
  --custom-compile-command "scripts/lock.sh" \
  --quiet -o requirements.lock
echo "wrote $ROOT/requirements.lock"
