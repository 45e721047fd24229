"""Private database servers that a test or script may crash and restart.

Never the shared servers: each instance lives in a fresh temporary directory
and listens on 127.0.0.1 on a free port, and is removed on :meth:`close`.

* :class:`PrivatePostgres`: ``initdb`` + ``pg_ctl`` as the ``postgres`` user
  (PostgreSQL refuses to run as root), trust authentication.
* :class:`PrivateMariaDB`: ``mariadb-install-db`` + ``mariadbd``, root with
  an empty password.

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

__all__ = ["PrivateMariaDB", "PrivatePostgres", "PrivateServer", "free_port"]


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
