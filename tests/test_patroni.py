"""dblock on a Patroni cluster (tests/support/patroni.py: etcd x3, two
PostgreSQL members under Patroni with ``synchronous_mode: true``, HAProxy on
Patroni's ``/primary`` check), reached both ways operators do: through
HAProxy, and with a libpq multi-host URL (``target_session_attrs=
read-write``). Failovers are Patroni's own: the leader's postgres killed, a
planned ``patronictl switchover``, the leader cut off from etcd (it demotes
itself, the other member takes over once the leader key expires).

Through each failover:

* a holder whose lease outlasts the failover keeps its lock: the row is on
  the synchronous standby Patroni promotes, and renewal reaches it;
* a holder whose lease does not is told (``on_lost``) once the lease it last
  confirmed runs out, never later: past that, another process may hold it;
* a waiter whose timeout is longer than the failover is granted, not failed;
* the LISTEN connection moves to the new leader: a release after the
  failover wakes a waiter by its notification (the re-check timer is set
  far beyond the test);
* fences keep growing.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from dblock import BackendError, LockLost, LockManager
from tests.support.patroni import PrivatePatroni
from tests.support.proxy import Proxy
from tests.support.sizes import FULL

pytestmark = pytest.mark.cluster

WAYS = ("haproxy", "multihost")


def _url(cluster: PrivatePatroni, way: str) -> str:
    return cluster.haproxy_url if way == "haproxy" else cluster.multihost_url


@pytest.fixture
def cluster(patroni: PrivatePatroni) -> Iterator[PrivatePatroni]:
    patroni.wait_healthy(90)
    with LockManager(patroni.haproxy_url) as m:
        m.create_schema()
    yield patroni
    patroni.wait_healthy(90)  # the next test starts on a healthy cluster


def test_every_way_to_the_leader(cluster: PrivatePatroni) -> None:
    """HAProxy, the SQLAlchemy multi-host URL (one ``host=`` per member) and
    the libpq form (``host=a,b&port=x,y``) all reach the leader."""
    ports = ",".join(str(m.port) for m in cluster.members)
    hosts = ",".join("127.0.0.1" for _ in cluster.members)
    libpq = (
        f"postgresql+psycopg://postgres@/postgres?host={hosts}&port={ports}"
        "&target_session_attrs=read-write"
    )
    key = f"ways:{uuid.uuid4().hex[:8]}"
    fences = []
    for url in (cluster.haproxy_url, cluster.multihost_url, libpq):
        with LockManager(url) as m, m.lock(key, timeout=5) as held:
            fences.append(held.fence)
    assert fences == sorted(fences)
    assert len(set(fences)) == 3


def _demotion_watch(cluster: PrivatePatroni, leader: Any) -> tuple[threading.Event, list[float]]:
    """When ``leader`` stopped being the primary (its ``/primary`` check first
    failed): the moment HAProxy and the demoted node's own clients learn it."""
    stop = threading.Event()
    seen: list[float] = []

    def watch() -> None:
        while not stop.is_set() and not seen:
            if leader.rest("/primary")[0] != 200:
                seen.append(time.monotonic())
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()
    return stop, seen


FAULTS = ("switchover", "etcd_cut", "pg_kill")
# The suite's short version: each fault once, each way at least once (a
# failover takes about 20 s here); DBLOCK_FULL=1 runs every fault by every way.
SHORT = {("haproxy", "switchover"), ("haproxy", "etcd_cut"), ("multihost", "pg_kill")}
CASES = [(way, fault) for fault in FAULTS for way in WAYS if FULL or (way, fault) in SHORT]


@pytest.mark.parametrize(("way", "fault"), CASES)
def test_failover(cluster: PrivatePatroni, way: str, fault: str) -> None:
    url = _url(cluster, way)
    prefix = f"patroni:{uuid.uuid4().hex[:8]}"
    long_key, short_key, wait_key = f"{prefix}:long", f"{prefix}:short", f"{prefix}:wait"
    # The waiters' re-check timer is beyond the test: only a notification
    # (or the listener's reconnection) wakes them before the holder's lease.
    options: dict[str, Any] = {"notify_recheck": 120.0, "poll_max": 0.2}
    holder = LockManager(url, ttl=60, **options)
    short = LockManager(url, ttl=3, **options)  # renewed every second
    waiter = LockManager(url, **options)
    try:
        kept = holder.acquire(long_key)
        lost_at: list[float] = []
        brief = short.acquire(short_key, on_lost=lambda h: lost_at.append(time.monotonic()))
        brief_fence = brief.fence
        # Queued before the fault: granted once the failover is over and the
        # short holder is gone, within its timeout.
        got: dict[str, Any] = {}

        def wait(key: str, timeout: float) -> None:
            # The waiting thread owns what it gets: it releases it itself.
            try:
                with waiter.lock(key, timeout=timeout) as held:
                    got[key] = (held.fence, time.monotonic())
            except Exception as exc:
                got[key] = exc

        waiters = [
            threading.Thread(target=wait, args=(short_key, 60.0)),
            threading.Thread(target=wait, args=(long_key, 120.0)),
        ]
        for t in waiters:
            t.start()
        time.sleep(0.5)  # both queued, listening

        before = cluster.leader()
        assert before is not None
        stop, demoted = _demotion_watch(cluster, before)
        report = cluster.fault(fault)
        stop.set()
        print(f"\n{way} {fault}: {report}")
        # The waiters' LISTEN connection is back soon after writes are: it
        # retries at least every half second, whatever the outage's length.
        listener = waiter.store._listener  # type: ignore[attr-defined]
        assert listener is not None
        assert listener.listening
        late = listener._listening_since - report["writes_back_at"][way]
        print(f"  LISTEN back {late:+.2f} s after writes were")
        assert late < 1.5

        # The long holder kept its lock across the failover: renewal reached
        # the new leader, whose row (synchronous standby) is still ours.
        kept_before = kept.expires_at
        deadline = time.monotonic() + 30
        while kept.expires_at == kept_before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not kept.lost, kept.lost_reason
        assert kept.expires_at > kept_before

        # The short holder: kept if its renewal found the new leader in time,
        # else lost at the end of the lease it last confirmed, and told so.
        if brief.lost:
            assert lost_at, "on_lost was not called"
            print(f"  short lease lost {lost_at[0] - demoted[0]:.2f} s after the demotion"
                  if demoted else "  short lease lost")  # fmt: skip
        else:
            brief.release()
        # The waiter for the short key is granted (the lease ran out, or the release).
        waiters[0].join(70)
        granted = got[short_key]
        assert isinstance(granted, tuple), granted
        assert granted[0] > brief_fence

        # The long holder releases now: its waiter must be woken by the
        # release's NOTIFY, heard on the listener's new connection.
        released_at = time.monotonic()
        kept.release()
        waiters[1].join(30)
        woken = got[long_key]
        assert isinstance(woken, tuple), woken
        wake = woken[1] - released_at
        print(f"  waiter woken {wake:.3f} s after the release (re-check timer 120 s)")
        assert wake < 3.0
        assert woken[0] > kept.fence

        # The fences of a key keep growing across the failover.
        with holder.lock(wait_key) as again:
            first = again.fence
        with waiter.lock(wait_key) as again:
            assert again.fence > first > granted[0]
    finally:
        for m in (holder, short, waiter):
            m.close()


def test_a_connection_left_on_a_standby_is_dropped(cluster: PrivatePatroni) -> None:
    """A pooled connection that reaches a standby (a demoted leader, behind a
    balancer that does not close the sessions of a server it marks down, a
    moved virtual IP, a pooler in front of one member) answers every write
    with "read-only" (SQLSTATE 25006). dblock drops that connection and the
    pool's older ones, so the next statement connects afresh, and reaches
    the leader wherever the route now points; it must not write to the
    standby forever."""
    leader = cluster.leader()
    assert leader is not None
    standby = next(m for m in cluster.members if m is not leader)
    route = Proxy("127.0.0.1", standby.port)  # the route still points at the old node
    key = f"standby:{uuid.uuid4().hex[:8]}"
    try:
        with LockManager(route.url_for(standby.url)) as m:
            with pytest.raises(BackendError, match="read-only"):
                m.acquire(key, blocking=False)
            route.target = ("127.0.0.1", leader.port)  # the route moves to the leader
            with m.lock(key, blocking=False) as held:
                assert held.fence > 0
    finally:
        route.close()


def test_a_holder_whose_route_stays_on_the_demoted_leader_is_told(
    cluster: PrivatePatroni,
) -> None:
    """A holder that reaches the database by the leader's own address (a
    single-host URL, a pooler or a virtual IP in front of that member) is
    left on a standby by a switchover: the old leader restarts as one. Its
    renewal is refused ("read-only") there, on a fresh connection too: the
    lock is declared lost at once, within one renewal interval of the
    demotion, not at the end of its lease (30 s)."""
    leader = cluster.leader()
    assert leader is not None
    lost_at: list[float] = []
    with LockManager(leader.url, ttl=30) as m:  # renewed every 10 s
        held = m.acquire(f"pinned:{uuid.uuid4().hex[:8]}",
                         on_lost=lambda h: lost_at.append(time.monotonic()))  # fmt: skip
        stop, demoted = _demotion_watch(cluster, leader)
        report = cluster.fault("switchover")
        deadline = time.monotonic() + 30
        while not lost_at and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        assert held.lost, "still held through a standby"
        assert "takes no writes" in (held.lost_reason or "")
        after = lost_at[0] - demoted[0]
        moved = f"{report['leader_before']} -> {report['leader_after']}"
        print(f"\nswitchover {moved}: lost {after:.2f} s after the demotion (renewal every 10 s)")
        assert after < 10.0 + 2.0
        with pytest.raises(LockLost):
            held.check()
        held.release()  # the row is left to its lease on the new leader (logged)
