"""``until=session``: hold a lock until a SQLAlchemy session's transaction ends.

A lock released before the transaction that wrote under it commits protects
nothing: the next holder reads the old data. With ``until=session``
(``LockManager.lock``, ``lock_many``, ``locked``; Flask-SQLAlchemy's
``db.session`` works too) a lock whose ``with`` block or function ends while
that session has a transaction open is released when the transaction ends
(commit, rollback or ``close()``), not before. Outside a transaction nothing
changes. dblock's own statements still run on their own connections.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session, SessionTransaction, scoped_session

from .deferral import DeferHook, Deferred, Trigger
from .errors import LockArgumentError

__all__ = ["session_hook"]

# session.info key: [(root transaction, trigger), ...] waiting for its end.
_PENDING = "dblock.pending_releases"

_DROPPED = (
    "its session was garbage-collected with its transaction still open; "
    "commit, roll back or close the session (until=session)"
)


def session_hook(until: object) -> DeferHook:
    """The defer hook for ``until``: a :class:`~sqlalchemy.orm.Session` or a
    :class:`~sqlalchemy.orm.scoped_session` (resolved at each exit), or their
    asyncio forms, an ``AsyncSession`` or ``async_scoped_session`` (whose
    transaction is their sync session's: the same events end it)."""
    found = _async_session_hook(until)
    if found is not None:
        return found
    if isinstance(until, Session):
        session = until
        return lambda deferred, result: _defer(session, deferred, result)
    if isinstance(until, scoped_session):
        scoped = until

        def from_scope(deferred: Deferred, result: Any) -> Any:
            if not scoped.registry.has():
                return result  # no session here yet: no transaction to cover
            return _defer(scoped(), deferred, result)

        return from_scope
    raise LockArgumentError(
        "until must be a SQLAlchemy Session or scoped_session (Flask-SQLAlchemy's "
        f"db.session), or an AsyncSession or async_scoped_session, got {until!r}"
    )


def _async_session_hook(until: object) -> DeferHook | None:
    """The hook for an ``AsyncSession`` or ``async_scoped_session``; None for
    anything else (and without SQLAlchemy's asyncio extension installed)."""
    try:
        from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session
    except ImportError:  # pragma: no cover - no greenlet: no async sessions either
        return None
    if isinstance(until, AsyncSession):
        session = until.sync_session
        return lambda deferred, result: _defer(session, deferred, result)
    if isinstance(until, async_scoped_session):
        scoped = until

        def from_scope(deferred: Deferred, result: Any) -> Any:
            if not scoped.registry.has():
                return result
            return _defer(scoped().sync_session, deferred, result)

        return from_scope
    return None


def _defer(session: Session, deferred: Deferred, result: Any) -> Any:
    root = session.get_transaction()
    if root is None or not root.is_active:
        return result
    pending: list[tuple[SessionTransaction, Trigger]] | None = session.info.get(_PENDING)
    if pending is None:
        pending = session.info[_PENDING] = []
        event.listen(session, "after_transaction_end", _transaction_ended)
    pending.append((root, deferred.trigger(dropped=_DROPPED)))
    return result


def _transaction_ended(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is not None:
        return  # a savepoint: the root transaction goes on
    pending: list[tuple[SessionTransaction, Trigger]] = session.info.get(_PENDING) or []
    if not pending:
        return
    ended = [trigger for tx, trigger in pending if tx is transaction]
    pending[:] = [(tx, trigger) for tx, trigger in pending if tx is not transaction]
    for trigger in ended:
        trigger()
