# Sourced by scripts/test: the Debian packages the test suite drives as real
# programs (a terminal for `dblock top`, a browser for the Django admin page,
# a private pgbouncer in front of PostgreSQL, gdb holding a private MariaDB's
# server thread at one instruction for the fence-order test, Galera for the
# cluster tests, faketime for schedulers on skewed clocks, and the Patroni
# cluster's etcd, Patroni and HAProxy).
# Installed when missing if we can (root with apt-get, as on CI); otherwise
# the tests that need them fail and name the package.
_dblock_need=()
command -v tmux >/dev/null 2>&1 || _dblock_need+=(tmux)
command -v chromium >/dev/null 2>&1 || _dblock_need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || _dblock_need+=(chromium-driver)
command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || _dblock_need+=(pgbouncer)
command -v gdb >/dev/null 2>&1 || _dblock_need+=(gdb)
command -v nm >/dev/null 2>&1 || _dblock_need+=(binutils)
# The cluster tests (marker `cluster`): a private Galera cluster (its provider,
# and rsync for state transfers; both come with Debian's mariadb-server) and
# a PostgreSQL primary + standby (the server binaries, as for the rest).
[ -e /usr/lib/galera/libgalera_smm.so ] || _dblock_need+=(galera-4)
command -v rsync >/dev/null 2>&1 || _dblock_need+=(rsync)
command -v ss >/dev/null 2>&1 || _dblock_need+=(iproute2)
# The jobs tests run schedulers on skewed clocks (libfaketime's faketime).
command -v faketime >/dev/null 2>&1 || _dblock_need+=(faketime)
# The Patroni cluster (tests/support/patroni.py, scripts/ha-patroni, torture
# --db patroni): etcd (v3 API), Patroni and HAProxy, run on private ports.
# Their packaged services must not run: apt here starts none (policy-rc.d /
# no systemd); tests/support/patroni.py starts and stops its own by PID.
[ -x /usr/bin/etcd ] || _dblock_need+=(etcd-server)
[ -x /usr/bin/patroni ] || _dblock_need+=(patroni)
[ -x /usr/sbin/haproxy ] || _dblock_need+=(haproxy)
if ((${#_dblock_need[@]})); then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "scripts: installing ${_dblock_need[*]} (Debian packages)" >&2
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq "${_dblock_need[@]}"; } >&2 \
            || echo "scripts: could not install ${_dblock_need[*]}; the tests that drive them will fail" >&2
    else
        echo "scripts: missing ${_dblock_need[*]}: install them (apt-get install ${_dblock_need[*]})" >&2
    fi
fi
unset _dblock_need
