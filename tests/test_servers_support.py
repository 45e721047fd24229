"""The private servers of tests/support/servers.py: a server that fails to
start leaves its logs where the failing test's output names them, and the
ports a server is given stay its own until it is closed.

A fresh-clone run of the suite once failed with "galera node 2 exited; see
…/node2/server.log", and the log went with the cluster's directory.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.support import servers
from tests.support.servers import GaleraNode, PrivateGalera, PrivateMariaDB, ServerFailed


@pytest.fixture
def kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    where = tmp_path / "kept"
    monkeypatch.setattr(servers, "LOGS_KEPT", where)
    return where


def _only_dir(where: Path) -> Path:
    found = list(where.iterdir())
    assert len(found) == 1, found
    return found[0]


def test_a_mariadb_that_does_not_start_keeps_its_log(kept: Path) -> None:
    with pytest.raises(ServerFailed) as failed:
        PrivateMariaDB("--no-such-option-of-mariadbd=1")
    message = str(failed.value)
    copy = _only_dir(kept)
    assert f"kept in {copy}" in message
    assert "no-such-option-of-mariadbd" in message  # the log's last lines, in the error
    logs = list(copy.iterdir())
    assert len(logs) == 1, logs
    assert logs[0].name.endswith("-server.log"), logs
    assert "no-such-option-of-mariadbd" in logs[0].read_text()


def test_a_galera_node_that_does_not_start_keeps_the_clusters_logs(
    kept: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[Path] = []
    write = GaleraNode.write_config

    def broken(node: GaleraNode, peers: list[int]) -> None:
        write(node, peers)
        made.append(node.cluster.dir)
        with node.cnf.open("a") as f:
            f.write("no-such-option-of-mariadbd=1\n")

    monkeypatch.setattr(GaleraNode, "write_config", broken)
    with pytest.raises(ServerFailed) as failed:
        PrivateGalera(1)
    message = str(failed.value)
    assert "galera node 0 exited" in message
    copy = _only_dir(kept)
    assert f"kept in {copy}" in message
    assert "no-such-option-of-mariadbd" in message
    assert "node0-server.log" in {p.name for p in copy.iterdir()}
    assert not made[0].exists()  # the cluster's own directory is gone, its logs are not


def test_a_held_port_is_handed_to_no_one_else_but_its_server_listens() -> None:
    held = servers.held_port()
    port = held.getsockname()[1]
    try:
        # Nobody else gets it, by port 0 or by name ...
        for _ in range(3000):
            assert servers.free_port() != port
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        # ... but the server (SO_REUSEADDR, as mariadbd, postgres, Galera and
        # rsync bind) listens on it, and again after a restart.
        for _ in range(2):
            with socket.socket() as server:
                server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                server.bind(("127.0.0.1", port))
                server.listen()
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        held.close()
