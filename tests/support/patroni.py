"""A private Patroni cluster on loopback: 3 etcd members, 2 (or 3) PostgreSQL
members each run by its own Patroni, and HAProxy in front of them routing to
the leader by Patroni's REST health check. Everything lives in one temporary
directory on free ports and is started and stopped by PID; the machine's own
PostgreSQL is never touched.

Debian's packages: ``etcd-server`` (etcd 3.4, the v3 API: Patroni's
``etcd3``), ``patroni``, ``haproxy`` and ``postgresql-15``
(:func:`ensure_packages` installs what is missing when run as root).

Each Patroni reaches each etcd member through a :class:`~tests.support.proxy.
Proxy` of its own (``use_proxies: true``, so Patroni does not discover and
bypass them): :meth:`PrivatePatroni.cut_from_etcd` cuts one member off the
consensus store, as a network partition would, without touching etcd.

Clients reach the leader either way operators do:

* :attr:`PrivatePatroni.haproxy_url`: HAProxy, ``option httpchk GET
  /primary`` against each member's Patroni REST port, ``on-marked-down
  shutdown-sessions`` (the sessions of a member that stops being the leader
  are closed, so no pooled connection stays on a demoted node);
* :attr:`PrivatePatroni.multihost_url`: every member in one libpq URL with
  ``target_session_attrs=read-write`` (:attr:`PrivatePatroni.conninfo` is the
  same as a libpq keyword string).

Timing (``bootstrap.dcs``): ``ttl`` 10 s, ``loop_wait`` 1 s,
``retry_timeout`` 4 s (Patroni wants ``loop_wait + 2 * retry_timeout <=
ttl``), ``synchronous_mode: true``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from .proxy import Proxy
from .servers import _pg_bin, free_port

__all__ = ["FAULTS", "PACKAGES", "Member", "PrivatePatroni", "WriteProbe", "ensure_packages"]

# Debian package -> a file it installs.
PACKAGES = {
    "etcd-server": "/usr/bin/etcd",
    "patroni": "/usr/bin/patroni",
    "haproxy": "/usr/sbin/haproxy",
}
SCOPE = "dblock"
TTL, LOOP_WAIT, RETRY_TIMEOUT = 10, 1, 4
# How long a supervisor (systemd's Restart=on-failure, RestartSec) takes to
# start a killed Patroni again.
PATRONI_RESTART_DELAY = 1.0
# The cluster faults, by the name the torture run and scripts/ha-patroni use.
FAULTS = ("pg_kill", "patroni_kill", "switchover", "etcd_cut", "etcd_down", "haproxy_restart")


def ensure_packages() -> None:
    """Install the Debian packages that are missing (as root, with apt-get),
    then fail with their names if any is still missing. Their own services
    are not started: Debian's ``policy-rc.d`` or the absence of systemd
    keeps them down, and :func:`_stop_package_daemons` makes sure."""
    missing = [name for name, path in PACKAGES.items() if not os.path.exists(path)]
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "install", "-y", "-q", *missing], env=env, check=False,
                       capture_output=True, timeout=900)  # fmt: skip
        _stop_package_daemons()
        missing = [name for name, path in PACKAGES.items() if not os.path.exists(path)]
    if missing:
        raise RuntimeError(
            f"the Patroni cluster needs {' '.join(missing)}: apt-get install -y {' '.join(missing)}"
        )


def _stop_package_daemons() -> None:
    """A postinst that did start its daemon (a machine with a working
    invoke-rc.d): stop exactly those, by the PID their pid files name."""
    for pidfile in ("/run/haproxy.pid", "/run/etcd.pid", "/run/patroni.pid"):
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(Path(pidfile).read_text().split()[0]), signal.SIGTERM)


def _stop(proc: subprocess.Popen[bytes] | None, timeout: float = 20.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _kill(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(10)


class Etcd:
    """One etcd member (as root: it needs nothing of postgres)."""

    def __init__(self, cluster: PrivatePatroni, index: int) -> None:
        self.cluster = cluster
        self.index = index
        self.name = f"etcd{index}"
        self.client_port = free_port()
        self.peer_port = free_port()
        self.data = cluster.dir / self.name
        self.proc: subprocess.Popen[bytes] | None = None
        self.state = "new"

    def start(self) -> None:
        c = self.cluster
        initial = ",".join(f"{e.name}=http://127.0.0.1:{e.peer_port}" for e in c.etcds)
        log = open(c.dir / f"{self.name}.log", "ab")  # noqa: SIM115 - etcd keeps it
        self.proc = subprocess.Popen(
            ["/usr/bin/etcd", "--name", self.name, "--data-dir", str(self.data),
             "--listen-client-urls", f"http://127.0.0.1:{self.client_port}",
             "--advertise-client-urls", f"http://127.0.0.1:{self.client_port}",
             "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
             "--initial-cluster", initial, "--initial-cluster-state", self.state,
             "--initial-cluster-token", f"dblock-{c.dir.name}",
             # Small: a lost member is noticed in half a second, not a second.
             "--heartbeat-interval", "100", "--election-timeout", "600",
             "--quota-backend-bytes", str(64 * 2**20), "--logger", "zap",
             "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        self.state = "existing"  # a restart rejoins with its data directory

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.client_port}/health", timeout=1
            ) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        _kill(self.proc)

    def stop(self) -> None:
        _stop(self.proc)


class Member:
    """One PostgreSQL member and the Patroni that runs it (as ``postgres``:
    Patroni runs initdb, pg_ctl and pg_basebackup itself)."""

    def __init__(self, cluster: PrivatePatroni, index: int) -> None:
        self.cluster = cluster
        self.index = index
        self.name = f"pg{index}"
        self.port = free_port()
        self.rest_port = free_port()
        self.data = cluster.dir / self.name
        self.config = cluster.dir / f"{self.name}.yml"
        # Its own way to each etcd member, which cut_from_etcd() can close.
        self.etcd_proxies = [Proxy("127.0.0.1", e.client_port) for e in cluster.etcds]
        self.proc: subprocess.Popen[bytes] | None = None

    def write_config(self) -> None:
        c = self.cluster
        hba = ["local all all trust", "host all all 127.0.0.1/32 trust",
               "host replication postgres 127.0.0.1/32 trust"]  # fmt: skip
        config: dict[str, Any] = {
            "scope": SCOPE,
            "name": self.name,
            "log": {"level": "INFO", "dir": str(c.dir), "file_num": 1, "file_size": 50 * 2**20},
            "restapi": {
                "listen": f"127.0.0.1:{self.rest_port}",
                "connect_address": f"127.0.0.1:{self.rest_port}",
            },
            "etcd3": {
                "hosts": [f"127.0.0.1:{p.port}" for p in self.etcd_proxies],
                "use_proxies": True,
            },
            "bootstrap": {
                "dcs": {
                    "ttl": TTL,
                    "loop_wait": LOOP_WAIT,
                    "retry_timeout": RETRY_TIMEOUT,
                    "maximum_lag_on_failover": 1048576,
                    # A commit returns only once the synchronous standby has
                    # it, and Patroni promotes only that standby: the lock
                    # rows and the fence sequence survive every failover.
                    "synchronous_mode": True,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "parameters": {
                            "wal_level": "replica",
                            "hot_standby": "on",
                            "wal_log_hints": "on",
                            "max_connections": 200,
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                            "wal_keep_size": "64MB",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}, "no-sync"],
                "pg_hba": hba,
            },
            "postgresql": {
                "listen": f"127.0.0.1:{self.port}",
                "connect_address": f"127.0.0.1:{self.port}",
                "data_dir": str(self.data),
                "bin_dir": str(Path(_pg_bin("pg_ctl")).parent),
                "pgpass": str(c.dir / f"{self.name}.pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres"},
                    "replication": {"username": "postgres"},
                },
                "parameters": {
                    "unix_socket_directories": str(c.dir),
                    "fsync": "off",  # a process crash, not a power cut: the page cache keeps it
                    "shared_buffers": "32MB",
                },
                "pg_hba": hba,
            },
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False},
        }
        # YAML is a superset of JSON: no YAML writer needed.
        self.config.write_text(json.dumps(config, indent=1))

    def start(self) -> None:
        log = open(self.cluster.dir / f"{self.name}.out", "ab")  # noqa: SIM115
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        self.proc = subprocess.Popen(
            [*prefix, "/usr/bin/patroni", str(self.config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.cluster.dir,
        )
        log.close()

    @property
    def patroni_pid(self) -> int:
        """The Patroni process itself (under runuser, when run as root)."""
        assert self.proc is not None
        if self.proc.args[0] != "runuser":  # type: ignore[index]
            return self.proc.pid
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        with contextlib.suppress(OSError, ValueError):
            return int(children.read_text().split()[0])
        return self.proc.pid

    @property
    def postmaster_pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int((self.data / "postmaster.pid").read_text().split()[0])
        return None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rest(self, path: str = "/patroni") -> tuple[int, dict[str, Any]]:
        """Patroni's REST answer: (HTTP status, JSON body); (0, {}) if down."""
        url = f"http://127.0.0.1:{self.rest_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as exc:
            with contextlib.suppress(ValueError):
                return exc.code, json.loads(exc.read() or b"{}")
            return exc.code, {}
        except (OSError, ValueError):
            return 0, {}

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def kill_patroni(self) -> None:
        """kill -9 of Patroni alone: its PostgreSQL keeps running, unsupervised."""
        os.kill(self.patroni_pid, signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait(10)

    def kill_postgres(self) -> int:
        """kill -9 of the postmaster (its backends notice and exit)."""
        pid = self.postmaster_pid
        if pid is None:
            raise RuntimeError(f"{self.name}: postgres is not running")
        os.kill(pid, signal.SIGKILL)
        return pid

    def stop(self) -> None:
        # SIGTERM: Patroni stops its PostgreSQL (fast), then itself.
        _stop(self.proc, timeout=30)
        pid = self.postmaster_pid
        if pid is not None:  # left over by a killed Patroni
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGQUIT)  # immediate shutdown
                for _ in range(100):
                    os.kill(pid, 0)
                    time.sleep(0.05)


class PrivatePatroni:
    """The cluster: ``with PrivatePatroni() as ha: ha.haproxy_url ...``"""

    def __init__(self, members: int = 2) -> None:
        ensure_packages()
        started = time.monotonic()
        # Twice at most: a port free_port() found can be taken by another
        # process before our server binds it (other test runs share the host).
        for attempt in (1, 2):
            try:
                self._start(members)
                break
            except Exception as exc:
                logs = self._log_tails()
                self.close()
                if attempt == 2:
                    raise RuntimeError(f"the Patroni cluster did not start: {exc}\n{logs}") from exc
                print(f"Patroni cluster: start failed ({exc}), once more\n{logs}", file=sys.stderr)
        self.start_seconds = time.monotonic() - started

    def _start(self, members: int) -> None:
        # Everything close() looks at first, so a start failing anywhere closes.
        self.etcds: list[Etcd] = []
        self.members: list[Member] = []
        self.haproxy: subprocess.Popen[bytes] | None = None
        self.dir = Path(tempfile.mkdtemp(prefix="dblock-patroni-"))
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres")
        self.haproxy_port = free_port()
        self.haproxy_stats_port = free_port()
        self.etcds = [Etcd(self, i) for i in range(3)]
        for e in self.etcds:
            e.start()
        self._until(lambda: all(e.healthy() for e in self.etcds), 30, "etcd is not healthy")
        self.members = [Member(self, i) for i in range(members)]
        for m in self.members:
            m.write_config()
        # The first one bootstraps (initdb); the others clone it once it leads.
        self.members[0].start()
        self._until(lambda: self.members[0].rest("/primary")[0] == 200, 60,
                    "the first member did not become the leader")  # fmt: skip
        for m in self.members[1:]:
            m.start()
        self.start_haproxy()
        self.wait_healthy(60)

    def _log_tails(self, lines: int = 15) -> str:
        """The end of every log in the cluster's directory, to tell why it failed."""
        out = []
        for path in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out")):
            with contextlib.suppress(OSError):
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(out)

    # -- addresses -------------------------------------------------------------

    @property
    def haproxy_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.haproxy_port}/postgres"

    @property
    def multihost_url(self) -> str:
        """Every member, ``target_session_attrs=read-write`` (SQLAlchemy's form
        of a libpq multi-host URL: one ``host=`` per member)."""
        hosts = "&".join(f"host=127.0.0.1:{m.port}" for m in self.members)
        return f"postgresql+psycopg://postgres@/postgres?{hosts}&target_session_attrs=read-write"

    @property
    def conninfo(self) -> str:
        """The same as a libpq keyword string (``host=a,b port=x,y ...``)."""
        hosts = ",".join("127.0.0.1" for _ in self.members)
        ports = ",".join(str(m.port) for m in self.members)
        return (
            f"host={hosts} port={ports} user=postgres dbname=postgres "
            "target_session_attrs=read-write"
        )

    # -- state -------------------------------------------------------------------

    def cluster_state(self) -> dict[str, Any]:
        """Patroni's view of the cluster (``GET /cluster`` on any member that answers)."""
        for m in self.members:
            status, body = m.rest("/cluster")
            if status == 200 and body:
                return body
        return {}

    def leader(self) -> Member | None:
        """The member whose Patroni says it is the primary (REST ``/primary``)."""
        for m in self.members:
            if m.rest("/primary")[0] == 200:
                return m
        return None

    def healthy(self) -> bool:
        """A leader, every member running and streaming, one synchronous standby,
        and HAProxy routing to the leader."""
        state = self.cluster_state()
        found = state.get("members", [])
        if len(found) != len(self.members):
            return False
        roles = sorted(str(m.get("role")) for m in found)
        states = {str(m.get("state")) for m in found}
        if "leader" not in roles or "sync_standby" not in roles:
            return False
        if not states <= {"running", "streaming"}:
            return False
        return self._haproxy_backend_up()

    def wait_healthy(self, timeout: float = 60.0) -> float:
        """Until :meth:`healthy`; returns how long that took."""
        started = time.monotonic()
        self._until(self.healthy, timeout, f"the Patroni cluster is not healthy: "
                    f"{json.dumps(self.cluster_state())}")  # fmt: skip
        return time.monotonic() - started

    def _haproxy_backend_up(self) -> bool:
        """One backend server UP in HAProxy's stats (CSV)."""
        try:
            url = f"http://127.0.0.1:{self.haproxy_stats_port}/;csv"
            with urllib.request.urlopen(url, timeout=1) as r:
                lines = r.read().decode().splitlines()
        except OSError:
            return False
        up = [ln for ln in lines if ln.startswith("postgres,pg") and ",UP," in ln]
        return len(up) == 1

    @staticmethod
    def _until(predicate: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise RuntimeError(what)
            time.sleep(0.1)

    def write_probe(self, url: str, timeout: float = 60.0) -> float:
        """Until a committed write through ``url`` succeeds (it waits for the
        synchronous standby); returns how long that took."""
        engine = sa.create_engine(
            url, poolclass=sa.pool.NullPool, connect_args={"connect_timeout": 1}
        )
        started = time.monotonic()
        try:
            while True:
                try:
                    with engine.begin() as conn:
                        conn.exec_driver_sql("SET LOCAL statement_timeout = 1000")
                        conn.exec_driver_sql(
                            "CREATE TABLE IF NOT EXISTS dblock_probe (t timestamptz)"
                        )
                        conn.exec_driver_sql("INSERT INTO dblock_probe VALUES (now())")
                    return time.monotonic() - started
                except Exception:
                    if time.monotonic() - started > timeout:
                        raise
                    time.sleep(0.05)
        finally:
            engine.dispose()

    # -- faults --------------------------------------------------------------------

    def cut_from_etcd(self, member: Member) -> None:
        """``member``'s Patroni loses every etcd member (a partition): its
        connections are closed and new ones refused."""
        for p in member.etcd_proxies:
            p.refuse(True)
            p.cut_all()

    def heal_etcd(self, member: Member) -> None:
        for p in member.etcd_proxies:
            p.refuse(False)

    def switchover(self, candidate: Member) -> None:
        """A planned ``patronictl switchover`` to ``candidate``."""
        leader = self.leader()
        if leader is None:
            raise RuntimeError("no leader to switch over from")
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        done = subprocess.run(
            [*prefix, "/usr/bin/patronictl", "-c", str(leader.config), "switchover", SCOPE,
             "--leader", leader.name, "--candidate", candidate.name, "--force"],
            capture_output=True, text=True, timeout=60, check=False, cwd=self.dir,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"patronictl switchover failed: {done.stdout}{done.stderr}")
        # patronictl may say "failed" and still exit 0: the new leader is the proof.
        self._until(lambda: self.leader() is candidate, 30,
                    f"switchover to {candidate.name} did not happen: {done.stdout}")  # fmt: skip

    def fault(self, kind: str, rng: random.Random | None = None) -> dict[str, Any]:
        """Inject one fault of :data:`FAULTS`, wait until the cluster is
        healthy again, and say what happened: the leader before and after,
        and how long writes were impossible through HAProxy and through the
        multi-host URL (the longest gap between two committed writes of a
        probe writing every 50 ms, from just before the fault)."""
        rng = rng or random.Random()
        before = self.leader()
        if before is None:
            raise RuntimeError("no leader before the fault")
        probes = [WriteProbe(self.haproxy_url), WriteProbe(self.multihost_url)]
        for p in probes:
            p.start()
        started = time.monotonic()
        detail = ""
        if kind == "pg_kill":
            before.kill_postgres()
            detail = f"kill -9 of {before.name}'s postgres"
        elif kind == "patroni_kill":
            before.kill_patroni()
            time.sleep(PATRONI_RESTART_DELAY)
            before.start()
            detail = (
                f"kill -9 of {before.name}'s Patroni, started again "
                f"{PATRONI_RESTART_DELAY:g} s later"
            )
        elif kind == "switchover":
            # In synchronous mode Patroni switches over to a synchronous standby only.
            sync = {m["name"] for m in self.cluster_state().get("members", [])
                    if m.get("role") == "sync_standby"}  # fmt: skip
            to = rng.choice([m for m in self.members if m.name in sync] or
                            [m for m in self.members if m is not before])  # fmt: skip
            self.switchover(to)
            detail = f"patronictl switchover {before.name} -> {to.name}"
        elif kind == "etcd_cut":
            self.cut_from_etcd(before)
            detail = f"{before.name} cut off from etcd until another member leads"
            try:
                self._until(
                    lambda: (m := self.leader()) is not None and m is not before,
                    3 * TTL,
                    "no other member took over",
                )
            finally:
                self.heal_etcd(before)
        elif kind == "etcd_down":
            e = rng.choice(self.etcds)
            e.kill()
            time.sleep(2.0)
            e.start()
            self._until(e.healthy, 30, f"{e.name} did not rejoin")
            detail = f"kill -9 of {e.name}, started again 2 s later"
        elif kind == "haproxy_restart":
            self.restart_haproxy()
            detail = "HAProxy killed and started again"
        else:
            raise ValueError(f"unknown fault {kind!r}")
        injected = time.monotonic() - started
        # Patroni may not have noticed yet (a killed postgres): healthy means
        # a write through each way in after the fault, and Patroni content.
        at = time.monotonic()
        self._until(lambda: all(p.ok and p.ok[-1] > at for p in probes), 90,
                    f"no write after {kind}")  # fmt: skip
        healthy = self.wait_healthy(90)
        for p in probes:
            p.stop()
        after = self.leader()
        return {
            "fault": kind,
            "detail": detail,
            "leader_before": before.name,
            "leader_after": after.name if after else None,
            "injected_s": round(injected, 3),
            "healthy_after_s": round(injected + healthy, 3),
            "writes_blocked_haproxy_s": round(probes[0].longest_gap(started), 3),
            "writes_blocked_multihost_s": round(probes[1].longest_gap(started), 3),
            # time.monotonic() of the first write after the longest gap
            "writes_back_at": {"haproxy": probes[0].back_at(started),
                               "multihost": probes[1].back_at(started)},
        }  # fmt: skip

    # -- HAProxy ---------------------------------------------------------------------

    def start_haproxy(self) -> None:
        servers = "\n".join(
            f"    server {m.name} 127.0.0.1:{m.port} maxconn 500 check port {m.rest_port}"
            for m in self.members
        )
        cfg = self.dir / "haproxy.cfg"
        cfg.write_text(
            f"""global
    maxconn 2000

defaults
    mode tcp
    retries 2
    timeout client 30m
    timeout connect 1s
    timeout server 30m
    timeout check 1s

listen stats
    mode http
    bind 127.0.0.1:{self.haproxy_stats_port}
    stats enable
    stats uri /

listen postgres
    bind 127.0.0.1:{self.haproxy_port}
    option httpchk GET /primary
    http-check expect status 200
    default-server inter 500ms fall 2 rise 1 on-marked-down shutdown-sessions
{servers}
"""
        )
        log = open(self.dir / "haproxy.log", "ab")  # noqa: SIM115
        # -db: stay in the foreground, so the PID is the one we started.
        self.haproxy = subprocess.Popen(
            ["/usr/sbin/haproxy", "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT
        )
        log.close()

    def restart_haproxy(self) -> None:
        """Stop HAProxy (its client sessions end) and start it again."""
        _kill(self.haproxy)
        self.start_haproxy()

    # -- life cycle --------------------------------------------------------------------

    def close(self) -> None:
        _kill(self.haproxy)
        for m in self.members:
            with contextlib.suppress(Exception):
                m.stop()
        for m in self.members:
            for p in m.etcd_proxies:
                p.close()
        for e in self.etcds:
            with contextlib.suppress(Exception):
                e.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PrivatePatroni:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WriteProbe:
    """A thread committing one small write every 50 ms through ``url`` (a new
    connection each time, as a client after a failover would make), keeping
    the times of the writes that committed."""

    def __init__(self, url: str) -> None:
        self._engine = sa.create_engine(
            url,
            poolclass=sa.pool.NullPool,
            connect_args={"connect_timeout": 2, "options": "-c statement_timeout=3000"},
        )
        self.ok: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="write-probe", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self._engine.begin() as conn:
                    conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS dblock_probe (t timestamptz)")
                    conn.exec_driver_sql("INSERT INTO dblock_probe VALUES (now())")
                self.ok.append(time.monotonic())
            except Exception:
                pass
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._engine.dispose()

    def back_at(self, since: float) -> float:
        """When writes came back: the end of the longest gap since ``since``."""
        times = [since, *(t for t in self.ok if t > since)]
        return max(itertools.pairwise(times), key=lambda p: p[1] - p[0], default=(0, since))[1]

    def longest_gap(self, since: float) -> float:
        times = [since, *(t for t in self.ok if t > since)]
        if len(times) == 1:
            return float("inf")
        return max(b - a for a, b in itertools.pairwise(times))


def main(argv: list[str] | None = None) -> int:
    """scripts/ha-patroni: start the cluster and wait (``up``), or run faults."""
    import argparse

    parser = argparse.ArgumentParser(prog="scripts/ha-patroni", description=main.__doc__)
    parser.add_argument("command", choices=("up", "faults"), nargs="?", default="up")
    parser.add_argument("--members", type=int, default=2, help="PostgreSQL members (2)")
    parser.add_argument("--fault", action="append", choices=FAULTS, help="faults: these only")
    parser.add_argument("--times", type=int, default=1, help="faults: rounds of each (1)")
    parser.add_argument("--json", help="faults: write the measurements here")
    args = parser.parse_args(argv)
    with PrivatePatroni(args.members) as ha:
        print(f"cluster up in {ha.start_seconds:.1f} s ({ha.dir})", file=sys.stderr)
        print(f"HAProxy:    {ha.haproxy_url}")
        print(f"multi-host: {ha.multihost_url}")
        print(f"libpq:      {ha.conninfo}")
        for m in ha.members:
            print(f"{m.name}: postgres 127.0.0.1:{m.port}, REST http://127.0.0.1:{m.rest_port}")
        sys.stdout.flush()
        if args.command == "up":
            print("Ctrl-C stops it and removes it.", file=sys.stderr)
            # Blocked first, or the signal goes to Python's handler and sigwait never returns.
            stop = {signal.SIGINT, signal.SIGTERM}
            signal.pthread_sigmask(signal.SIG_BLOCK, stop)
            signal.sigwait(stop)
            return 0
        rng = random.Random(7)
        results = []
        for _ in range(args.times):
            for kind in args.fault or FAULTS:
                r = ha.fault(kind, rng)
                results.append(r)
                print(json.dumps(r), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
