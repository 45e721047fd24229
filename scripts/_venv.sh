# Sourced by scripts/demo, scripts/test and scripts/bench: make .venv and
# install dblock with its development extras into it, again whenever
# pyproject.toml changes.
set -euo pipefail
: "${PYTHON:=python3}"
if [ ! -x .venv/bin/python ]; then
    echo "scripts: creating .venv with $($PYTHON --version)" >&2
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.dblock-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "scripts: installing dblock[dev] into .venv" >&2
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e '.[dev]'
    echo "$want" > "$stamp"
fi
