# Sourced by scripts/demo, scripts/test and scripts/bench: make a virtual
# environment and install dblock (editable) into it, again whenever
# pyproject.toml or the extras asked for change.
#
#   DBLOCK_VENV     the environment's directory (default .venv)
#   DBLOCK_EXTRAS   the extras to install, comma-separated (default dev: every
#                   driver, integration, test and documentation tool; empty:
#                   dblock alone, SQLAlchemy and its two small companions)
#   PYTHON          the interpreter that makes it (default python3)
#
# The stamp records both the pyproject.toml it installed from and the
# extras, so `scripts/test` after a lighter install still gets [dev].
set -euo pipefail
: "${PYTHON:=python3}"
: "${DBLOCK_VENV:=.venv}"
: "${DBLOCK_EXTRAS=dev}"
if [ ! -x "$DBLOCK_VENV/bin/python" ]; then
    echo "scripts: creating $DBLOCK_VENV with $($PYTHON --version)" >&2
    "$PYTHON" -m venv "$DBLOCK_VENV"
fi
_dblock_stamp="$DBLOCK_VENV/.dblock-installed"
# (For dev, the hash alone: the stamp every .venv made before carries.)
_dblock_want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
[ "$DBLOCK_EXTRAS" = dev ] || _dblock_want="$_dblock_want [$DBLOCK_EXTRAS]"
if [ "$(cat "$_dblock_stamp" 2>/dev/null)" != "$_dblock_want" ]; then
    _dblock_spec=.
    [ -z "$DBLOCK_EXTRAS" ] || _dblock_spec=".[$DBLOCK_EXTRAS]"
    echo "scripts: installing dblock${DBLOCK_EXTRAS:+[$DBLOCK_EXTRAS]} into $DBLOCK_VENV" >&2
    if [ "$DBLOCK_EXTRAS" = dev ]; then
        "$DBLOCK_VENV/bin/python" -m pip install --quiet --upgrade pip
    fi
    "$DBLOCK_VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$_dblock_spec"
    echo "$_dblock_want" > "$_dblock_stamp"
fi
unset _dblock_stamp _dblock_want _dblock_spec
