"""Signal handlers held back while a third party's bookkeeping runs.

CPython runs a Python signal handler on the main thread between two
bytecodes, wherever that thread is; a handler that raises (a ``SIGALRM``
request timeout, Celery's soft time limit, gunicorn's graceful timeout,
Ctrl-C) raises there. dblock's own code is written for that (the
interruption walks visit every point of it), but SQLAlchemy's pool is not:
an exception as ``Condition.__enter__`` returns in its queue leaves the
queue's mutex held for good (every later checkout hangs), and one between
counting an overflow connection and the ``try`` that uncounts it leaves the
count wrong (the pool ends exhausted with nothing checked out). The signal
storm found both within a few hundred operations.

So where dblock's executor hands control to the pool (a checkout, a return,
an invalidation) it calls through :func:`shielded`: for that call the
main thread's Python-level handlers are swapped for :func:`_hold`, which
holds a signal that lands deeper in the stack than the shield, and the
held handlers run, in order, as the shield returns, in dblock's frame.
Waits that may block (the pool's wait for a connection, the driver's
connect and pre-ping) are :func:`unshielded` windows inside: a handler
runs there at once, as an error of the connect or the wait would, which
the pool undoes.

Whether a signal is held is decided from the interrupted frame's stack (a
shield's frame above it, no window between), never from a flag the
handler's own exception could leave set: a handler swapped and not yet put
back still runs the application's handler outside a shield.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # (CPython's C module: see _swap)
import contextlib
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

__all__ = ["handlers_exception", "shielded", "unshielded", "wait"]

R = TypeVar("R")

Handler = Callable[[int, FrameType | None], Any]

# Signals a Python handler may be set for; the synchronous ones (a fault in
# native code) and those that cannot be caught are left alone.
_SIGNALS: tuple[int, ...] = tuple(
    sorted(
        signal.valid_signals()
        - {
            getattr(signal, name)
            for name in ("SIGKILL", "SIGSTOP", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT")
            if hasattr(signal, name)
        }
    )
)

# The application's handlers while _hold stands in for them, by signal.
_saved: dict[int, Handler] = {}
# Signals held by a shield: (signal, the frame it landed in).
_held: list[tuple[int, FrameType | None]] = []
_main = threading.main_thread().ident


def _hold(signum: int, frame: FrameType | None) -> None:
    f = frame
    while f is not None:
        code = f.f_code
        if code is _WINDOW:
            break
        if code is _SHIELD:
            if f is not frame:  # inside the shielded call: held until it returns
                _held.append((signum, frame))
                return
            break
        f = f.f_back
    handler = _saved.get(signum)
    if callable(handler):
        try:
            handler(signum, frame)
        except BaseException as exc:
            # In a window (a driver's connect): the driver may wrap it in an
            # error of its own (psycopg's conninfo parsing turns whatever
            # it meets into "bad value for connect_timeout"); marked, the
            # executor gives the application its own exception back.
            with contextlib.suppress(AttributeError, TypeError):
                setattr(exc, _MARK, True)
            raise


_MARK = "_dblock_raised_by_a_signal_handler"


def handlers_exception(exc: BaseException) -> BaseException | None:
    """The exception a signal handler raised inside a window of a shield,
    if ``exc`` is a driver's error made of it (found through the causes and
    contexts of ``exc``, however the driver chained it)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if getattr(e, _MARK, False) is True:
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _swap() -> None:
    # The C module's calls: signal.getsignal() wraps each answer in an enum,
    # which costs more than the rest of a shield.
    getsignal = _signal.getsignal
    for signum in _SIGNALS:
        handler = getsignal(signum)
        if callable(handler) and handler is not _hold:
            _saved[signum] = handler
            _signal.signal(signum, _hold)


def _restore() -> None:
    for signum, handler in list(_saved.items()):
        if _signal.getsignal(signum) is _hold:
            _signal.signal(signum, handler)
        del _saved[signum]


def _outermost() -> bool:
    """Whether no other shield is on the calling shield's stack."""
    f: FrameType | None = sys._getframe(2)  # _outermost <- shielded <- its caller
    while f is not None:
        if f.f_code is _SHIELD:
            return False
        f = f.f_back
    return True


def _deliver() -> None:
    """Run the held handlers, the application's, in the order they came (the
    first one that raises ends it; the rest are sent again, for their
    handlers to run at the next chance)."""
    while _held:
        signum, frame = _held.pop(0)
        handler = _signal.getsignal(signum)
        if handler is _hold:
            handler = _saved.get(signum)
        try:
            if callable(handler):
                handler(signum, frame)
        except BaseException:
            again = [s for s, _ in _held]
            _held.clear()
            for s in again:
                signal.raise_signal(s)
            raise


def _settle() -> None:
    """The application's handlers back, and those held run."""
    _restore()
    if _held:
        _deliver()


def _call(func: Callable[..., R], args: tuple[Any, ...]) -> R:
    # A frame of its own: a handler due as a C function returns runs here,
    # below the shield (held), not in the shield's frame.
    return func(*args)


def shielded(func: Callable[..., R], *args: Any, undo: Callable[[R], Any] | None = None) -> R:
    """``func(*args)`` with the main thread's signal handlers held until it
    returns (on another thread: just the call; handlers run on the main
    one). A held handler that raises as the shield returns raises in the
    caller's frame, ``undo(result)`` having given back what ``func`` got."""
    if threading.get_ident() != _main:
        return func(*args)
    outermost = _outermost()
    try:
        if outermost:
            _swap()
        result = _call(func, args)
    except BaseException:
        if outermost:
            _settle()  # a held handler's exception wins, as CPython's would
        raise
    if outermost:
        try:
            _settle()
        except BaseException:
            if undo is not None:
                _undo(undo, result)
            raise
    return result


def _undo(undo: Callable[[R], Any], result: R) -> None:
    # Shielded too (an exception is on its way up: one more is not wanted
    # inside the pool): what lands meanwhile is sent again afterwards.
    _swap()
    try:
        with contextlib.suppress(Exception):  # the pool's trouble; the handler's goes on
            _call(undo, (result,))
    finally:
        _restore()
        again = [s for s, _ in _held]
        _held.clear()
        for s in again:
            signal.raise_signal(s)


def unshielded(func: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """``func(*args, **kwargs)`` inside a shield, with handlers running as
    they come: for a wait that may block, which a handler's exception then
    interrupts as a timeout or a connect error would (the pool undoes
    those). Held handlers run first."""
    if _held and threading.get_ident() == _main:
        _deliver()
    return func(*args, **kwargs)


def wait(condition: threading.Condition, lock: Any, timeout: float | None) -> bool:
    """``condition.wait(timeout)`` on a condition over the RLock ``lock``,
    which the caller holds: held again, whatever cut the wait off. CPython's
    ``Condition.wait`` releases the lock before the ``try`` that takes it
    back; a handler's exception as that release returns left it released,
    and the caller's ``with`` then released it once more (RuntimeError,
    the handler's exception lost; with a plain Lock, another thread's hold:
    the signal storm found both)."""
    try:
        return condition.wait(timeout)
    except BaseException:
        shielded(_own, lock)
        raise


def _own(lock: Any) -> None:
    if not lock._is_owned():  # (the RLock's own answer: is it this thread's?)
        lock.acquire()


_SHIELD = shielded.__code__
_WINDOW = unshielded.__code__
