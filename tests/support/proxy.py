"""A TCP proxy between a client and a database server that can cut connections.

Used by the tests (ambiguous acquire) and by ``scripts/torture.py``. It
forwards bytes both ways, one thread per direction, and on request:

* ``cut_after(marker)``: when a client packet containing ``marker`` has been
  forwarded *and the server has answered it*, close both sides without passing
  the answer on. The statement ran; the client never hears how it went.
* ``cut_before(marker)``: drop the connection instead of forwarding the packet.
* ``hold(marker)``: keep the packet until ``let_go`` is set, then forward it,
  even if the client has hung up meanwhile (a statement that reaches the
  server after its client gave up on it, as on a slow network).
* ``cut_all()``: close every open connection now.
* ``refuse(True)``: accept new connections and close them at once (a database
  that cannot be reached), until ``refuse(False)``.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from dataclasses import dataclass, field

import sqlalchemy as sa


@dataclass
class _Rule:
    marker: bytes
    after_reply: bool
    fired: threading.Event = field(default_factory=threading.Event)
    # Set for hold(): forward the packet once this is set, instead of cutting.
    let_go: threading.Event | None = None
    # cut_after(refuse=True): refuse new connections from the cut on.
    refuse: bool = False


class Proxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._rule: _Rule | None = None
        self._refusing = False
        self._pairs: set[tuple[socket.socket, socket.socket]] = set()
        self._closed = False
        self.connections = 0
        self.accepted = 0  # every connection a client opened, even if not forwarded
        self._thread = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)
        self._thread.start()

    # -- control -----------------------------------------------------------

    def cut_after(self, marker: bytes, *, refuse: bool = False) -> threading.Event:
        """Arm a one-shot cut after the server answers a packet with ``marker``;
        the returned event is set once it fired. ``refuse``: an outage begins
        with the cut (new connections refused until ``refuse(False)``)."""
        rule = _Rule(marker, after_reply=True, refuse=refuse)
        with self._lock:
            self._rule = rule
        return rule.fired

    def cut_before(self, marker: bytes) -> threading.Event:
        rule = _Rule(marker, after_reply=False)
        with self._lock:
            self._rule = rule
        return rule.fired

    def hold(self, marker: bytes) -> tuple[threading.Event, threading.Event]:
        """Arm a one-shot hold of the next client packet with ``marker``:
        returns (held, let_go). ``held`` is set once the packet is held; it
        goes to the server when the caller sets ``let_go``."""
        rule = _Rule(marker, after_reply=False, let_go=threading.Event())
        with self._lock:
            self._rule = rule
        assert rule.let_go is not None
        return rule.fired, rule.let_go

    def refuse(self, on: bool) -> None:
        with self._lock:
            self._refusing = on

    def cut_all(self) -> None:
        with self._lock:
            pairs = list(self._pairs)
        for a, b in pairs:
            _close(a)
            _close(b)

    def close(self) -> None:
        self._closed = True
        _close(self._listener)
        self.cut_all()

    def url_for(self, url: str) -> str:
        """``url`` with host and port replaced by the proxy's."""
        return (
            sa.make_url(url)
            .set(host="127.0.0.1", port=self.port)
            .render_as_string(hide_password=False)
        )

    # -- plumbing ----------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                refusing = self._refusing
                self.accepted += 1
            if refusing:
                _close(client)
                continue
            try:
                server = socket.create_connection(self.target, timeout=5)
                server.settimeout(None)
            except OSError:
                _close(client)
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._pairs.add((client, server))
                self.connections += 1
            threading.Thread(
                target=self._pump, args=(client, server), name="proxy-pump", daemon=True
            ).start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        fired: _Rule | None = None
        try:
            while True:
                readable, _, _ = select.select([client, server], [], [])
                if client in readable:
                    data = client.recv(65536)
                    if not data:
                        return
                    with self._lock:
                        rule = self._rule
                        hit = rule is not None and rule.marker in data
                        if hit:
                            self._rule = None
                    if hit:
                        assert rule is not None
                        if rule.let_go is not None:
                            rule.fired.set()
                            rule.let_go.wait()
                            server.sendall(data)
                            continue
                        if rule.after_reply:
                            server.sendall(data)
                            server.recv(65536)  # the answer, swallowed
                            if rule.refuse:
                                with self._lock:
                                    self._refusing = True
                        fired = rule
                        return
                    server.sendall(data)
                if server in readable:
                    data = server.recv(65536)
                    if not data:
                        return
                    client.sendall(data)
        except (OSError, ValueError):  # ValueError: closed under us by cut_all()
            return
        finally:
            _close(client)
            _close(server)
            with self._lock:
                self._pairs.discard((client, server))
            if fired is not None:
                fired.fired.set()


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    s.close()
