"""Level 1: the in-process registry of local locks. No SQL lives here.

One :class:`Entry` per key that some thread of this process holds or waits
for. The entry's ``owner`` is the thread (a :class:`ThreadOwner`, never a
recyclable thread id) or asyncio task that holds the key locally, ``depth``
counts its re-entrant acquisitions, and ``queue`` holds the other local
threads waiting for it, first come first served. When the owner leaves, the
key goes straight to the head of the queue (the owner field changes hands
under the registry mutex, so no third thread can slip in), or the entry is
deleted: memory follows the keys in use, not the keys ever seen.

Reads on the fast paths (re-entrant acquire, fail-fast refusal) take no lock:
a dict lookup is atomic, and ``entry.owner`` can only become *our* identity by
our own hand, so comparing it with ours is safe without the mutex.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections import deque
from typing import Any

from .errors import ManagerClosed

__all__ = [
    "CLOSED",
    "Entry",
    "HandedOn",
    "Registry",
    "ThreadOwner",
    "Waiter",
    "current_owner",
    "owner_alive",
    "owner_gone_reason",
    "owner_name",
    "thread_owner",
]


class _Anchor:
    """Kept only by its thread's thread-local state: it dies with the thread."""

    __slots__ = ("__weakref__",)


class ThreadOwner:
    """A thread as a lock owner.

    Never a thread id: ids are recycled, and a new thread given a dead
    holder's id must not be handed its lock. This object lives as long as
    anything refers to it, so it cannot be reused; it knows whether its thread
    still runs because the only strong reference to its anchor is in that
    thread's thread-local state, which the interpreter clears when the thread
    ends (also for threads not started by :mod:`threading`).
    """

    __slots__ = ("_anchor", "name", "thread")

    def __init__(self, anchor: _Anchor, thread: threading.Thread) -> None:
        self._anchor = weakref.ref(anchor)
        self.name = thread.name
        #: The thread itself, for its current name (it may be renamed).
        self.thread = thread

    def alive(self) -> bool:
        return self._anchor() is not None

    def __repr__(self) -> str:
        return f"<thread {self.name!r}>"


_local = threading.local()


def _new_thread_owner() -> ThreadOwner:
    anchor = _Anchor()
    owner = ThreadOwner(anchor, threading.current_thread())
    _local.anchor = anchor
    _local.owner = owner
    return owner


def current_owner() -> object:
    """Who is asking: the running asyncio task if there is one, else the thread.

    Tasks sharing a thread must not count as one holder, or a task would
    re-enter a lock another task of the same event loop holds.
    """
    aio = sys.modules.get("asyncio")
    if aio is not None and aio._get_running_loop() is not None:
        task = aio.current_task()
        if task is not None:
            return task
    try:
        return _local.owner
    except AttributeError:
        return _new_thread_owner()


def thread_owner() -> ThreadOwner | None:
    """This thread's owner object, if it ever asked for a lock (cheap: no
    event loop check; for the release path's "is it ours?")."""
    try:
        return _local.owner  # type: ignore[no-any-return]
    except AttributeError:
        return None


class HandedOn:
    """The owner of a lock that a task running nothing but the acquire took
    and returned as its result (``asyncio.wait_for`` before Python 3.12,
    ``create_task``, ``gather``): whoever awaits that task, known only once
    it uses the lock. Holds the task weakly: a task keeps its result, so a
    strong reference here would keep a dropped lock alive for ever."""

    __slots__ = ("loop", "name", "task")

    def __init__(self, task: Any) -> None:
        self.task = weakref.ref(task)
        self.name = task.get_name()
        # Whoever awaits the task runs on its loop: once that is closed,
        # nobody can ever use (or release) the lock (see owner_alive).
        self.loop = task.get_loop()

    def get_loop(self) -> Any:
        return self.loop

    def returned(self) -> bool:
        """Has the acquiring task returned the lock (so its awaiter may have it)?"""
        task = self.task()
        return task is None or bool(task.done())


def owner_alive(owner: object) -> bool:
    """Can the thread (or asyncio task) still run? A task whose event loop
    is closed cannot, though it is not done: nothing will ever resume it."""
    if isinstance(owner, ThreadOwner):
        return owner.alive()
    done = getattr(owner, "done", None)
    if done is not None and done():
        return False
    get_loop = getattr(owner, "get_loop", None)
    return get_loop is None or not get_loop().is_closed()


def owner_gone_reason(owner: object) -> str:
    """Why :func:`owner_alive` said no, for the WARNING that releases its lock."""
    get_loop = getattr(owner, "get_loop", None)
    if get_loop is not None and get_loop().is_closed():
        return f"its holder, {owner_name(owner)}, can never run again (its event loop is closed)"
    return f"its holder, {owner_name(owner)}, ended without releasing it"


def owner_name(owner: object) -> str:
    """The owner, for people: ``thread 'worker-3'`` or ``task 'Task-7'``."""
    if isinstance(owner, ThreadOwner):
        return f"thread {owner.name!r}"
    if isinstance(owner, HandedOn):
        return f"whoever awaited task {owner.name!r}"
    get_name = getattr(owner, "get_name", None)
    return f"task {get_name()!r}" if get_name is not None else repr(owner)


#: What a queued waiter is handed when the manager closes.
CLOSED: Any = object()


class Waiter:
    """A local thread queued for a key. ``ticket`` is what it asked for and
    ``grant`` what the previous owner hands over with the key (both opaque
    here: level 2 decides what they mean). ``granted`` turns true when the key
    is handed to it (under the mutex), ``ready`` once ``grant`` is filled in."""

    __slots__ = ("_signal", "entry", "grant", "granted", "owner", "ready", "ticket")

    def __init__(self, entry: Entry, owner: object, ticket: Any) -> None:
        self.entry = entry
        self.owner = owner
        self.ticket = ticket
        self.granted = False
        self.ready = False
        self.grant: Any = None
        self.arm()

    def arm(self) -> None:
        """Make what wakes this waiter: a lock the thread blocks on (the
        asyncio face's waiter makes a future of its loop instead)."""
        self._signal = threading.Lock()
        self._signal.acquire()

    def alive(self) -> bool:
        """Can it still take the key? (A blocked thread always can; a task
        whose event loop is closed never will.)"""
        return True

    def wait(self, timeout: float | None) -> bool:
        return self._signal.acquire(timeout=-1 if timeout is None else max(timeout, 0.0))

    def wake(self, grant: Any) -> None:
        self.grant = grant
        self.ready = True
        if self.entry.heir is self:
            self.entry.heir = None
        self._signal.release()

    def settle(self) -> BaseException | None:
        """Wait until ``grant`` is filled in, whatever interrupts us (the grant
        must be taken, then passed on, never dropped); returns the first
        exception that interrupted the wait, for the caller to raise."""
        pending: BaseException | None = None
        while not self.ready:
            try:
                self._signal.acquire(timeout=0.05)
            except BaseException as exc:  # a signal handler's
                pending = pending or exc
        return pending


#: The queue of an entry nobody queued for yet (most entries): one shared
#: empty deque that stays empty (``maxlen=0``), replaced by a deque of the
#: entry's own when the first waiter joins (see :meth:`Registry.join`).
_NO_QUEUE: deque[Waiter] = deque(maxlen=0)


class Entry:
    __slots__ = ("depth", "handoffs", "heir", "held", "key", "leaving", "owner", "queue")

    def __init__(self, key: str, owner: object) -> None:
        self.key = key
        self.owner = owner
        self.depth = 1
        self.queue: deque[Waiter] = _NO_QUEUE
        # What level 2 holds for this key (opaque here: a weak reference, so the
        # registry never keeps an unreachable lock alive) and how many times in
        # a row it was handed to a local waiter without going back to the database.
        self.held: Any = None
        self.handoffs = 0
        # Its lock was released and the release's statement is on its way:
        # the releasing thread passes the key on when it returns, whatever
        # became of the owner (a deferred release may outlive it).
        self.leaving = False
        # The waiter the key was last passed to, until it is woken: the
        # passer's own clean-up wakes it if a signal handler's exception
        # lands between the two (see Locker._leave), or it would wait for ever.
        self.heir: Waiter | None = None


class Registry:
    """The map ``key -> Entry`` of one process."""

    __slots__ = ("_entries", "_mutex", "_peak", "closed")

    # Dicts never shrink on deletion; after a burst of many concurrent keys a
    # fresh dict gives the memory back once the registry is empty again.
    _SHRINK_AFTER = 1024

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        self._mutex = threading.Lock()
        self._peak = 0
        self.closed = False

    def __len__(self) -> int:
        return len(self._entries)

    def table_bytes(self) -> int:
        """The size of the key table itself (``sys.getsizeof`` of the dict,
        not of its entries): what the benchmarks' memory figure reads."""
        return sys.getsizeof(self._entries)

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def claim(self, key: str, owner: object) -> Entry | None:
        """Take the key if nobody holds or waits for it; ``None`` if somebody does."""
        with self._mutex:
            if self.closed:
                raise ManagerClosed("this LockManager is closed")
            entries = self._entries
            if key in entries:
                return None
            entry = entries[key] = Entry(key, owner)
            self._peak = max(self._peak, len(entries))  # _grew(), inlined: the hot path
            return entry

    def left_behind(self, key: str, owner: object) -> Entry | Waiter | None:
        """What a request of ``owner`` interrupted inside :meth:`claim` or
        :meth:`join` left here (a signal handler's exception lands after any
        call, so also after the entry or the waiter went in and before the
        method returned): the entry it claimed, or its place in the queue.
        Nobody else would give them back while that owner lives on."""
        with self._mutex:
            entry = self._entries.get(key)
            if entry is None:
                return None
            for waiter in entry.queue:
                if waiter.owner is owner:
                    return waiter
            if entry.owner is owner and entry.held is None and not entry.leaving:
                return entry
            return None

    def join(
        self, key: str, owner: object, ticket: Any = None, waiter_type: type[Waiter] | None = None
    ) -> Entry | Waiter:
        """Take the key, or queue for it: returns the entry if we own it now,
        else a :class:`Waiter` (or ``waiter_type``, an asyncio task's kind) to
        wait on (then :meth:`abandon` on timeout)."""
        with self._mutex:
            if self.closed:
                raise ManagerClosed("this LockManager is closed")
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = Entry(key, owner)
                self._grew()
                return entry
            waiter = (waiter_type or Waiter)(entry, owner, ticket)
            if entry.queue is _NO_QUEUE:
                entry.queue = deque()
            entry.queue.append(waiter)
            return waiter

    def abandon(self, key: str, waiter: Waiter) -> bool:
        """A waiter gives up. False if the key was handed to it meanwhile: it
        must then wait for the (imminent) wake-up and take what it was given."""
        with self._mutex:
            if waiter.granted:
                return False
            entry = self._entries.get(key)
            if entry is not None and waiter in entry.queue:
                entry.queue.remove(waiter)
            return True

    def pop_waiter(self, entry: Entry) -> Waiter | None:
        """Make the head of the queue the owner; the caller wakes it with its
        grant. ``None`` (and nothing changes) if nobody waits."""
        if not entry.queue:
            # Most releases: nobody queued. A thread queueing right after
            # this check is handed the key by leave(), under the mutex.
            return None
        with self._mutex:
            return self._pass(entry)

    def leave(self, entry: Entry, owner: object = None) -> Waiter | None:
        """The owner is done with the key: hand it to the next waiter (returned,
        for the caller to wake) or forget the key. With ``owner``, only if it
        still owns the key: a second call after the first passed it on (a
        clean-up repeating a step that may or may not have run) changes
        nothing."""
        with self._mutex:
            if self._entries.get(entry.key) is not entry:
                return None  # evicted meanwhile (see evict): nothing of ours left
            if owner is not None and entry.owner is not owner:
                return None  # passed on already
            waiter = self._pass(entry) if entry.queue else None
            if waiter is None:
                del self._entries[entry.key]
                if not self._entries and self._peak > self._SHRINK_AFTER:
                    self._entries = {}
                    self._peak = 0
            return waiter

    def close(self) -> list[Waiter]:
        """Refuse every new claim and take every waiter out of its queue; the
        caller wakes them with :data:`CLOSED`."""
        with self._mutex:
            self.closed = True
            waiters: list[Waiter] = []
            for entry in self._entries.values():
                while entry.queue:
                    waiter = entry.queue.popleft()
                    waiter.granted = True
                    waiters.append(waiter)
            return waiters

    def evict(self, entry: Entry, owner: object) -> tuple[bool, Waiter | None]:
        """Take the key from ``owner`` if it still has it and no lock of
        level 2 (see :meth:`stranded`): (evicted, the waiter now owning it)."""
        with self._mutex:
            if self._entries.get(entry.key) is not entry or entry.owner is not owner:
                return False, None
            if entry.held is not None or entry.leaving:
                return False, None
            waiter = self._pass(entry) if entry.queue else None
            if waiter is None:
                del self._entries[entry.key]
            return True, waiter

    def adopt(self, entry: Entry, old: object, new: object) -> bool:
        """Make ``new`` the owner of ``entry``'s key if ``old`` still is (a
        lock handed on by a task of its own: see :class:`HandedOn`)."""
        with self._mutex:
            if self._entries.get(entry.key) is not entry or entry.owner is not old:
                return False
            entry.owner = new
            return True

    def stranded(self) -> list[Entry]:
        """Entries whose owner can never run again and holds no lock of
        level 2 yet (a task of a closed event loop, stopped mid-acquire):
        nobody would ever pass them on. (Not one being released: its
        releaser passes it on.)"""
        with self._mutex:
            entries = list(self._entries.values())
        return [e for e in entries if e.held is None and not e.leaving and not owner_alive(e.owner)]

    def clear(self) -> None:
        """Forget everything (a forked child must not inherit its parent's holders)."""
        self._entries = {}
        self._mutex = threading.Lock()
        self._peak = 0

    def _pass(self, entry: Entry) -> Waiter | None:
        queue = entry.queue
        while queue:
            waiter = queue[0]
            if waiter.alive():
                break
            # Its event loop is closed: the key handed to it would stay
            # with a task nobody will ever run, and every waiter behind it.
            # (Dropped as if it had given up: if its coroutine is ever
            # closed, abandon() finds it gone from the queue.)
            queue.popleft()
        else:
            return None
        # All of it marked before the one call (the pop): a signal handler's
        # exception can land after it, and the caller then finds the waiter
        # as the entry's heir (see Entry.heir).
        entry.owner = waiter.owner
        entry.depth = 1
        entry.leaving = False
        entry.heir = waiter
        waiter.granted = True
        queue.popleft()
        return waiter

    def _grew(self) -> None:
        n = len(self._entries)
        self._peak = max(self._peak, n)
