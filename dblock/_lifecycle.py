"""A lock's life after its grant, and the locks nobody releases.

Ownership (a lock handed on by a task that only acquired it), lease
extension by hand, and the release of locks whose holder cannot release
them: its owner ended (the renewal pass), it was dropped unreleased (its
weak reference's callback), the manager closes, the interpreter exits.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import _threads
from ._held import HeldLock, LockRef
from ._lockbase import LockerBase
from ._store.base import Lease
from .errors import LockLost, LockNotHeld, LockTimeout
from .registry import (
    Entry,
    HandedOn,
    ThreadOwner,
    current_owner,
    owner_alive,
    owner_gone_reason,
    owner_name,
    thread_owner,
)
from .steps import Op, Release, Sleep, noop

log = logging.getLogger("dblock")

_monotonic = time.monotonic
_current_thread = threading.current_thread
_thread_owner = thread_owner


class Lifecycle(LockerBase):
    """Ownership, extension, revocation and collection of held locks."""

    def release_later(self, held: HeldLock) -> None:
        """Release ``held`` on the renewal thread, quietly: its holder asked
        for it but was interrupted before its turn came (a signal handler's
        exception or a task's cancellation while the locks of ``lock_many``
        went one by one). Without this they stayed until the holder ended,
        and were then reported as never released."""
        entry = held.state.entry
        if entry.depth > 1 and entry.held is held.state:
            entry.depth -= 1
            return
        if not self._claim(held):
            return  # released already, by its holder or by dblock
        held.state.released = True
        entry.leaving = True  # its releaser's until passed on (see Registry)
        if self.telemetry is not None:
            self.telemetry.released(_monotonic() - held.state.acquired_mono)
        self.renewer.post(functools.partial(self._let_revoked_go, held))

    def handed_on(self, held: HeldLock) -> None:
        """``held`` was taken by a task that ran nothing but the acquire and
        so ends at once (``asyncio.wait_for`` before Python 3.12,
        ``create_task``, ``gather``): the lock is the task's result, handed
        to whoever awaits it. That task's end does not abandon it (the
        renewal pass leaves it be); the first task or thread to use it
        (``release()``, ``owned()``) becomes its owner. Dropped unused, it
        is collected and released like any other."""
        task = held.state.holder
        placeholder = HandedOn(task)
        if not self.local or self.registry.adopt(held.state.entry, task, placeholder):
            held.state.holder = placeholder
            held.state.adopt = True

    def adopt(self, held: HeldLock) -> None:
        """The caller becomes the owner of a handed-on lock (see :meth:`handed_on`)."""
        old = held.state.holder
        if not held.state.adopt or not isinstance(old, HandedOn) or not old.returned():
            return  # the acquiring task has not even returned it yet
        me = current_owner()
        if held.state.released or not self.local or self.registry.adopt(held.state.entry, old, me):
            held.state.holder = me
        held.state.adopt = False

    @staticmethod
    def check_owner(held: HeldLock) -> None:
        """Refuse a release by anyone but the holder, as ``threading.RLock`` does.
        (A lock taken by a thread outside any task may be released by a task
        running on that same thread: the thread is the holder.)"""
        me = current_owner()
        if held.state.adopt:
            held._locker.adopt(held)
        if (
            held.state.holder is not me
            and held.state.holder is not _thread_owner()
            and not held.state.released
        ):
            raise LockNotHeld(
                f"lock {held.key!r} is held by {owner_name(held.state.holder)}, not by "
                f"{owner_name(me)}: only its holder may release it "
                "(release(force=True) hands the release over explicitly)"
            )

    def _abandon(self, held: HeldLock, reason: str, *, closing: bool = False) -> None:
        """Release a lock whose holder cannot: its owner ended, or the manager
        closes. It is marked lost (``check()`` and ``release()`` raise
        :class:`LockLost`) and its ``on_lost`` is called."""
        if self._revoke(held, reason, closing):
            self._let_revoked_go(held)

    def _revoke(self, held: HeldLock, reason: str, closing: bool) -> bool:
        """The first half of :meth:`_abandon`, no SQL: take the job of
        releasing ``held`` and mark it lost. False if another has it."""
        if not self._claim(held):
            return False
        if closing:
            log.error("dblock: lock %r released and lost: %s", held.key, reason)
        else:
            log.warning("dblock: lock %r released: %s", held.key, reason)
        if held.state.lost is None:
            held.state.lost = reason
            self.renewer.notify_lost(held)
        held.state.revoked = True
        held.state.released = True
        return True

    def _let_revoked_go(self, held: HeldLock) -> None:
        """The second half of :meth:`_abandon`: delete the row, pass the key on."""
        entry = held.state.entry
        try:
            self.run(self._delete_row(held.key, held.token))
        finally:
            if entry.held is held.state:
                entry.leaving = True  # (before held: see _let_go)
                entry.held = None
                self._leave(entry)

    def _take_back(
        self, entry: Entry, me: object, blocking: bool, timeout: float | None, start: float
    ) -> Op[Entry | None]:
        """The owner asks again for a key whose lock it dropped without
        release (collected; its release is posted to the renewal thread).
        Release it here and keep the key at level 1 (returned: level 2
        follows), or, if the renewal thread is releasing it already, wait
        until it has passed the key on (None: ask for it as anyone would).
        A waiting request gives up at its timeout there: that DELETE may
        wait for a row lock or an unreachable server. A fail-fast one waits
        for it as for a statement of its own (the key is nobody else's; its
        own INSERT would wait for the same row lock)."""
        key = entry.key
        ref: LockRef | None = entry.held
        if ref is not None and ref() is None and ref.live:
            # Claimed here, as _claim_collected does, with no call since the
            # test: cut off anywhere after it (its log line, the DELETE), the
            # claim was ours and nobody else would finish it; the key stayed
            # this thread's at level 1 for good (seen by the signal storm).
            ref.live = False
            owner = entry.owner
            try:
                entry.held = None
                entry.depth = 1
                entry.handoffs = 0
                self.renewer.untrack_token(ref.token)
                log.warning("dblock: lock %r was never released by its holder; releasing it", key)
                yield from self._delete_row(key, ref.token)
            except BaseException:
                # As a release cut off: the row to the orphans (by token: a
                # second DELETE finds nothing), the key passed on at level 1.
                self.store.add_orphan(key, ref.token, released=True)
                self.renewer.post(noop)
                try:
                    self._leave(entry, None, owner)
                except BaseException:
                    self._leave(entry, None, owner)  # (cut off as it started)
                    raise
                raise
            return entry
        # The renewal thread (or close()) is releasing it: a DELETE away, or
        # longer (a row lock, a server away): look again, less often.
        pause = 0.001
        while self.registry.get(key) is entry and entry.owner is me:
            ref = entry.held
            if ref is not None and ref() is not None:
                break  # (never: only we could have taken it again)
            if blocking and timeout is not None and _monotonic() - start >= timeout:
                raise LockTimeout(key, timeout=timeout, level=1)
            yield Sleep(pause)
            pause = min(pause * 2, 0.02)
        return None

    def _reap(self) -> None:
        """On the renewal thread: a key whose local owner can never run
        again (a task of a closed event loop, stopped while it acquired)
        and holds no row yet is passed on to the next local waiter, instead
        of keeping every thread and task of the process out for ever. (One
        that holds a row is the renewal pass's: released like a dead thread's.)"""
        if not self.local:
            return
        for entry in self.registry.stranded():
            owner = entry.owner
            evicted, waiter = self.registry.evict(entry, owner)
            if evicted:
                log.warning(
                    "dblock: lock %r passed on at level 1: %s",
                    entry.key,
                    owner_gone_reason(owner),
                )
                if waiter is not None:
                    waiter.wake(None)

    def _collected(self, ref: LockRef) -> None:
        """Weak-reference callback: a held lock nobody can reach any more.
        Runs wherever the last reference went (even inside a mutex), so it
        only warns and hands the release to the renewal thread."""
        if not ref.live or self.pid != os.getpid():
            # (A forked child's copy of its parent's lock: the parent's to release.)
            return
        try:
            warnings.warn(
                f"dblock: lock {ref.key!r} was never released; releasing it now",
                ResourceWarning,
                stacklevel=2,
            )
        finally:
            # No new thread at interpreter exit: the lease ends it then.
            with contextlib.suppress(RuntimeError):
                self.renewer.post(lambda: self._release_collected(ref))

    def _claim_collected(self, ref: LockRef) -> bool:
        """Take the job of releasing a collected lock: True for exactly one
        of the renewal thread, close() and the owner's next acquire of its
        key (one atomic pop, ``untrack``, decides)."""
        if not ref.live:
            return False
        ref.live = False  # (no call since the test: see _let_go)
        self.renewer.untrack_token(ref.token)
        log.warning("dblock: lock %r was never released by its holder; releasing it", ref.key)
        return True

    def _release_collected(self, ref: LockRef) -> None:
        if not self._claim_collected(ref):
            return
        entry = ref.entry
        try:
            self.run(self._delete_row(ref.key, ref.token))
        finally:
            if entry.held is ref:
                entry.leaving = True  # (before held: see _let_go)
                entry.held = None
                self._leave(entry)

    def extend(self, held: HeldLock, ttl: float) -> None:
        self.check_extend(held)
        sent_at = _monotonic()
        self.extended(held, self.store.renew([(held.key, held.token, ttl)]), sent_at)

    def check_extend(self, held: HeldLock) -> None:
        """Before ``extend()`` sends its statement (no SQL): the lock must be
        held and not known to be lost."""
        if held.state.released:
            self.release(held)  # raises the right error, without SQL
        if held.state.lost is not None:
            raise LockLost(held.key, held.state.lost)

    def extended(self, held: HeldLock, leases: Mapping[str, Lease], sent_at: float) -> None:
        """What the renew statement sent at ``sent_at`` answered for ``held``
        (written once for ``HeldLock.extend`` and the awaited one)."""
        lease = leases.get(held.token)
        if lease is None:
            self.renewer.lose(held, "its row was gone or held by another owner at extend()")
            raise LockLost(held.key, held.state.lost or "its row was gone or held by another owner")
        held._renewed(lease.expires_at, sent_at + lease.expires_in)

    #: Seconds interpreter exit waits for the database to answer its
    #: releases (see :meth:`release_at_exit`); then the rows are left to their leases.
    EXIT_RELEASES = 3.0

    def release_at_exit(
        self, seconds: float, cut: list[BaseException] | None = None
    ) -> threading.Event | None:
        """At interpreter exit (``dblock.manager``'s atexit hook): take every
        lock whose holder can never run again (the main thread, whose code
        is done; a thread or task that ended; a task whose loop no longer
        runs) and delete its row on the renewal thread, which still runs
        (a daemon). Returns the event set once they are deleted (None: none
        to delete); the caller waits for it at most ``seconds``. A lock held
        by a thread that still runs (a daemon thread, which runs until the
        interpreter stops it) is left to its lease: releasing it could let
        another process in while its holder still works under it.

        Nothing here for a forked child (its registry was cleared; a child
        forked by other means must not release its parent's rows), nor for
        a row released already: a job's row kept for ``at_least`` stays.
        ``cut``: where an exception that cut the claims short goes (the
        locks claimed so far are still released), for the caller to raise
        once it has waited."""
        if self.pid != os.getpid() or self._closing:
            return None  # (closed: close() released what it held)
        me = _current_thread()
        # Kept on the locker, not in a local: a run cut off after claiming
        # (the renewal pass then stops watching what it claimed) leaves them
        # to the next run, atexit's second call (see dblock.manager).
        candidates = self._exit_candidates
        try:
            candidates.extend(
                held
                for held in self.renewer.held_locks()
                if not _runs_at_exit(held.state.holder, me)
            )
            for held in candidates:
                ref = held.state
                if not ref.live:
                    continue  # somebody else claimed it first
                # Claimed and marked with no call in between (see _let_go):
                # the mark, not a list it joins, says it is ours to delete.
                ref.live = False
                held.state.released = True
                held.state.revoked = True
                held.state.lost = AT_EXIT
                entry = held.state.entry
                if entry.held is ref:
                    entry.leaving = True  # (before held: see _let_go)
                    entry.held = None
        except BaseException as exc:
            # Whatever cut the loop off (a signal handler's exception at
            # exit), the locks claimed so far are released below; the
            # caller raises it once they are.
            if cut is None:
                raise
            cut.append(exc)
        posted = self._exit_posted
        taken = [h for h in candidates if h.state.lost is AT_EXIT and h.token not in posted]
        for held in taken:
            self.renewer.untrack(held)
        if not taken and not self.renewer.running:
            return None
        # Posted after whatever the renewal thread has in hand (a collected
        # lock's release, as when a script's last reference to it went at
        # its end): done once that is sent too.
        done = threading.Event()

        def release_all() -> None:
            try:
                for held in taken:
                    entry = held.state.entry
                    try:
                        deleted = self.run(_release_op(held.key, held.token))
                    except Exception as exc:  # logged; the lease ends the row
                        log.warning(
                            "dblock: lock %r could not be released at interpreter exit; its "
                            "row stays until its lease ends or the sweeper removes it: %s",
                            held.key,
                            exc,
                        )
                    else:
                        log.info(
                            "dblock: lock %r %s at interpreter exit (%s had not released it)",
                            held.key,
                            "released" if deleted else "found gone (not ours any more)",
                            owner_name(held.state.holder),
                        )
                    finally:
                        self._leave(entry)
            finally:
                done.set()

        try:
            self.renewer.post(release_all)
            posted.update(held.token for held in taken)
        except RuntimeError:  # no renewal thread, and none can start now
            done.set()
            log.warning(
                "dblock: %d lock(s) still held at interpreter exit (%s) are left to their "
                "leases (at most %g s): no thread could release them",
                len(taken),
                ", ".join(repr(h.key) for h in taken),
                max(h.ttl for h in taken),
            )
        return done


def release_at_close(
    locks: Sequence[Any], release: Callable[[Any], object], seconds: float
) -> None:
    """Run ``release`` for each of ``locks`` (already marked lost) on a
    thread of its own, and wait for it at most ``seconds``: a server that
    stopped answering (frozen, a stalled disk, a black-holed network) must
    not keep ``close()`` for ever. The releases left go on by themselves and
    end when it answers again; the rows meanwhile are left to their leases.
    A failure is logged once per lock, never raised past the clean-up."""

    def release_all() -> None:
        for held in locks:
            try:
                release(held)
            except Exception as exc:
                log.warning(
                    "dblock: lock %r could not be released at close; its row stays "
                    "until its lease ends or the sweeper removes it: %s",
                    held.key,
                    exc,
                )

    worker = threading.Thread(target=release_all, name="dblock-close", daemon=True)
    try:
        _threads.start(worker)
    except RuntimeError:  # at interpreter exit: no new thread
        release_all()
        return
    worker.join(seconds)
    if worker.is_alive():
        log.error(
            "dblock: the database did not answer close()'s releases of %d lock(s) "
            "within %g s; close() returns, the releases finish when it answers, "
            "and until then the rows are left to their leases",
            len(locks),
            seconds,
        )


#: What a lock released at interpreter exit is marked lost with (and how
#: release_at_exit knows the locks it claimed).
AT_EXIT = "released at interpreter exit"


def _release_op(key: str, token: str) -> Op[bool]:
    deleted: bool = yield Release(key, token)
    return deleted


def _runs_at_exit(owner: object, me: threading.Thread) -> bool:
    """At interpreter exit: can ``owner`` still run? Only a thread other
    than the exiting one that has not ended (a daemon thread), or a task of
    a loop running on such a thread."""
    if isinstance(owner, ThreadOwner):
        return owner.alive() and owner.thread is not me
    if not owner_alive(owner):
        return False
    get_loop = getattr(owner, "get_loop", None)
    return get_loop is not None and get_loop().is_running()
