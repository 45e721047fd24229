# Sourced by scripts/demo, scripts/test and scripts/bench: make a virtual
# environment and install dblock (editable) into it, again whenever
# pyproject.toml or the extras asked for change.
#
#   DBLOCK_VENV     the environment's directory (default .venv)
#   DBLOCK_EXTRAS   the extras to install, comma-separated (default dev: every
#                   driver, integration, test and documentation tool, and the
#                   benchmark suite's dependency group, bench; empty:
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
    # dev also takes the benchmark suite's dependency group (pyproject.toml).
    _dblock_group=()
    [ "$DBLOCK_EXTRAS" != dev ] || _dblock_group=(--group bench)
    "$DBLOCK_VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
        -e "$_dblock_spec" "${_dblock_group[@]}"
    echo "$_dblock_want" > "$_dblock_stamp"
fi
# dev also gets mysqlclient, the C driver for MySQL/MariaDB (dblock[mysqlclient]),
# apart: it builds against libmariadb, which apt-get installs here as root. If
# it cannot be built the rest stands and tests/test_mysqlclient.py fails,
# naming what is missing.
if [ "$DBLOCK_EXTRAS" = dev ] && ! "$DBLOCK_VENV/bin/python" -c "import MySQLdb" 2>/dev/null; then
    if ! pkg-config --exists libmariadb 2>/dev/null && ! pkg-config --exists mysqlclient 2>/dev/null \
        && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "scripts: installing libmariadb-dev pkg-config gcc (Debian packages, to build mysqlclient)" >&2
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq libmariadb-dev pkg-config gcc; } >&2 || true
    fi
    echo "scripts: installing mysqlclient into $DBLOCK_VENV" >&2
    "$DBLOCK_VENV/bin/python" -m pip install --quiet --disable-pip-version-check "mysqlclient>=2.2" \
        || echo "scripts: could not build mysqlclient (needs libmariadb-dev, pkg-config, gcc); tests/test_mysqlclient.py will fail" >&2
fi
unset _dblock_stamp _dblock_want _dblock_spec _dblock_group
