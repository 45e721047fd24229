"""Private database servers that a test or script may crash and restart.

Never the shared servers: each instance lives in a fresh temporary directory
and listens on 127.0.0.1 on a free port, and is removed on :meth:`close`.

* :class:`PrivatePostgres`: ``initdb`` + ``pg_ctl`` as the ``postgres`` user
  (PostgreSQL refuses to run as root), trust authentication.
* :class:`PrivateMariaDB`: ``mariadb-install-db`` + ``mariadbd``, root with
  an empty password.
* :class:`PgBouncer`: Debian's ``pgbouncer`` in transaction mode in front of
  a PostgreSQL server (the shared one by default), run as ``postgres``.

``crash()`` stops the server the way a power cut would (PostgreSQL's
immediate shutdown, SIGKILL for MariaDB: both recover from their logs on
start); ``start()`` brings it back on the same port and data directory.
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
from pathlib import Path

import sqlalchemy as sa

__all__ = ["PgBouncer", "PrivateMariaDB", "PrivatePostgres", "PrivateServer", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PrivateServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pg_bin(tool: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{tool}"))
    if found:
        return found[-1]
    path = shutil.which(tool)
    if path is None:
        raise RuntimeError(f"PostgreSQL's {tool} is not installed (looked in /usr/lib/postgresql)")
    return path


class PrivatePostgres(PrivateServer):
    name = "postgresql"

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="dblock-pg-"))
        self.port = free_port()
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            shutil.chown(self.dir, "postgres")
        self.data = self.dir / "data"
        self._pg(_pg_bin("initdb"), "-D", str(self.data), "--auth=trust", "-U", "postgres",
                 "-E", "UTF8", "--no-sync")  # fmt: skip
        self.start()

    def _pg(self, *args: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if self._as_postgres else []
        _run([*prefix, *args])

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1"
        self._pg(_pg_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"),
                 "-o", options, "-w", "start")  # fmt: skip
        self.wait_ready()

    def crash(self) -> None:
        self._pg(_pg_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def stop(self) -> None:
        self._pg(_pg_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")


class PrivateMariaDB(PrivateServer):
    name = "mariadb"

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="dblock-maria-"))
        self.port = free_port()
        self.data = self.dir / "data"
        self._proc: subprocess.Popen[bytes] | None = None
        install = shutil.which("mariadb-install-db") or shutil.which("mysql_install_db")
        if install is None:
            raise RuntimeError("mariadb-install-db is not installed")
        _run([install, "--no-defaults", f"--datadir={self.data}", "--skip-test-db",
              "--auth-root-authentication-method=normal", "--user=root"])  # fmt: skip
        self.start()
        engine = sa.create_engine(self.url.rsplit("/", 1)[0] + "/", poolclass=sa.pool.NullPool)
        with engine.connect() as conn:
            conn.exec_driver_sql("CREATE DATABASE IF NOT EXISTS test")
        engine.dispose()

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
             f"--pid-file={self.dir / 'pid'}", "--skip-log-bin", "--max-connections=500"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        try:
            self._wait_up()
        except BaseException:
            self.crash()
            raise

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
        self.port = free_port()
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
        except BaseException:
            self.crash()
            raise

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
