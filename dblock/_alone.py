"""The lone request's acquire: a key nobody of this process holds or
waits for, granted at the first try, without the step machinery."""

from __future__ import annotations

import os
import time

from ._held import HeldLock, LockOptions
from ._lockbase import (
    LIVE_LEASE,
    Claimed,
    FirstTry,
    LockerBase,
)
from ._store import Grant, Holder
from ._store.batch import until_for
from .errors import ManagerClosed
from .registry import Entry, Waiter
from .steps import noop
from .telemetry import Watch, outcome_of

_monotonic = time.monotonic
_urandom = os.urandom


class Alone(LockerBase):
    """The common acquire, inlined (see :meth:`_acquire_alone`)."""

    def _acquire_alone(  # noqa: PLR0912, PLR0915, PLR0917 - the hot path, inlined
        self,
        key: str,
        me: object,
        blocking: bool,
        timeout: float | None,
        ttl: float,
        opts: LockOptions,
    ) -> HeldLock:
        """The common request (a key nobody of this process holds or waits
        for, granted at the first try) without the step machinery: claim the
        key, send the one statement, keep the grant. Anything else (the key
        claimed meanwhile, the row held elsewhere, a failed or interrupted
        statement) goes on in :meth:`acquire_steps`, handed what was done so
        far: the claimed key, the token and the first try's outcome. At one
        thread per process the machinery's own work was a tenth of a grant's
        client CPU (most of it cache misses after each round trip)."""
        start = _monotonic()
        store = self.store
        try:
            entry = None if self._closing or store.has_orphans else self.registry.claim(key, me)
        except BaseException:
            try:
                self.run(self._forget_left_behind(key, me))
            except BaseException:
                # Cut off as it started (a signal at a frame's first
                # instruction): once more, it finds what the first left.
                self.run(self._forget_left_behind(key, me))
                raise
            raise
        if entry is None:
            return self.run(
                self.acquire_steps(
                    key, me, blocking=blocking, timeout=timeout, ttl=ttl, opts=opts,
                    waiter_type=Waiter, start=start,
                )
            )  # fmt: skip
        held: HeldLock | None = None
        first: Grant | Holder | BaseException | None = None
        token = ""
        try:
            token = _urandom(16).hex()
            owner = self.owner_label(me)
            request = store.executor.request
            deadline = None if timeout is None else start + timeout
            request.deadline = deadline
            batcher = self.batcher
            sent_at = _monotonic()
            try:
                if batcher is None:
                    first = store.try_acquire(key, token, owner, ttl)
                else:
                    until = until_for(deadline, sent_at)
                    first = batcher.try_acquire(key, token, owner, ttl, until)
            except BaseException as exc:
                first = exc
            finally:
                request.deadline = None
            if isinstance(first, Grant) and first.sent_at is not None:
                sent_at = first.sent_at  # a grouped statement's, sent after we queued
            if not isinstance(first, Grant) or (
                sent_at + first.expires_in - _monotonic() < ttl * LIVE_LEASE
            ):
                # Not granted at once (or granted a lease that ran out on
                # the way): on with the machinery, as if it had made the
                # try. It gives the key back on any failure; this try still
                # covers the instant before it starts (a signal there), and a
                # second leave of one entry changes nothing.
                claimed = Claimed(entry, token, owner, FirstTry(sent_at, first))
                return self.run(
                    self.acquire_steps(
                        key, me, blocking=blocking, timeout=timeout, ttl=ttl, opts=opts,
                        waiter_type=Waiter, start=start, claimed=claimed,
                    )
                )  # fmt: skip
            held = self.held_type(self, entry, token, owner, ttl, first, sent_at, opts)
            self._keep(entry, held)
            if self._closing:
                raise ManagerClosed(f"the LockManager was closed while acquiring {key!r}")
            if self.telemetry is not None:
                self.telemetry.granted_at_once()
            return held
        except BaseException as exc:
            try:
                self._alone_failed(exc, entry, me, token=token, held=held, first=first)
            except BaseException:
                # Cut off as it started: once more (each of its steps is
                # done once: the claim, the orphan's token, the leave's owner).
                self._alone_failed(exc, entry, me, token=token, held=held, first=first)
                raise
            raise

    def _alone_failed(
        self,
        exc: BaseException,
        entry: Entry,
        me: object,
        *,
        token: str,
        held: HeldLock | None,
        first: Grant | Holder | BaseException | None,
    ) -> None:
        """:meth:`_acquire_alone` ends in ``exc``: give back what it had."""
        if held is not None:
            if self.telemetry is not None:
                Watch(self.telemetry, entry.key).done(*outcome_of(exc))
            self.run(self._give_back(held))
            return
        if isinstance(first, Grant):
            # Granted, and interrupted before the held lock existed: the row
            # is deleted at once, not left for its lease.
            self.store.add_orphan(entry.key, token)
            self.renewer.post(noop)
        # Not if the machinery returned a held lock and we were interrupted
        # before returning it: level 1 goes with that lock's release (when it
        # is collected), not before its row is gone.
        if entry.owner is me and entry.held is None:
            self._leave(entry, None, me)
