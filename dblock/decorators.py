"""The locking decorator behind ``LockManager.locked`` and the integrations.

A decorated call builds its key (or keys) from its own arguments, holds the
lock(s) for the call, and when the lock cannot be had does what ``on_busy``
says: raise (the default), or call a handler with the error and the call's
arguments and return what it returns (:func:`returns` makes a handler that
returns a fixed value). Everything that can be checked without a call is
checked when the decorator is applied: the template's fields against the
signature, the options, the handler's signature.

The manager is looked up per call through ``resolve``, so the integrations
can decorate at import time, before their application is configured.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, Protocol, TypeVar

from .adeferral import acall_deferring
from .config import (
    check_lease,
    check_max_hold,
    check_on_lost,
    check_timeout,
    check_wait,
)
from .deferral import DeferHook, call_deferring
from .errors import LockArgumentError, LockNotAcquired
from .keys import KeyTemplate, check_key
from .lock import UNSET, HeldLock
from .multi import HeldLocks, order_keys
from .options import LockArgs, lock_args

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "Acquirer",
    "AsyncAcquirer",
    "BusyHandler",
    "KeySpec",
    "OnBusy",
    "alocked",
    "locked",
    "returns",
]

P = ParamSpec("P")
R = TypeVar("R")

#: ``handler(error, *args, **kwargs)``: called instead of the function when its
#: lock is not granted (``error`` is the LockBusy or LockTimeout).
BusyHandler = Callable[..., Any]
OnBusy = Literal["raise"] | BusyHandler
#: One format string, a list of them (several keys, taken with ``lock_many``),
#: or a callable taking the function's arguments and returning a key or keys.
KeySpec = str | Sequence[str] | Callable[..., str | Iterable[str]]


class Acquirer(Protocol):
    """What a decorated call needs of its manager (``LockManager``, a floor
    above this module: named here so no import runs up)."""

    @property
    def acquire(self) -> Callable[..., HeldLock]: ...

    @property
    def acquire_many(self) -> Callable[..., HeldLocks]: ...


class AsyncAcquirer(Protocol):
    """The same for a coroutine function's manager (``AsyncLockManager``)."""

    @property
    def acquire(self) -> Callable[..., Awaitable[Any]]: ...

    @property
    def acquire_many(self) -> Callable[..., Awaitable[Any]]: ...


def returns(value: Any) -> BusyHandler:
    """An ``on_busy`` handler that returns ``value`` when the lock is busy."""

    def busy(*_args: Any, **_kwargs: Any) -> Any:
        return value

    busy.__qualname__ = busy.__name__ = f"returns({value!r})"
    return busy


def locked(
    resolve: Callable[[], Acquirer],
    spec: KeySpec,
    *,
    on_busy: OnBusy = "raise",
    defer: DeferHook | None = None,
    fair: bool = False,
    **given: Unpack[LockArgs],
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A decorator holding the lock(s) named by ``spec`` around each call.

    ``resolve`` returns the :class:`~dblock.LockManager` to use, at call time.
    ``defer`` (see :mod:`dblock.deferral`) may make the release wait for
    ends outside the call (a transaction's commit, a response's close).
    The other arguments are those of ``LockManager.locked``.
    """
    options = _checked_options(given, on_busy)
    _fair_option(options, fair, spec)

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        if isinstance(func, (classmethod, staticmethod)):
            # Applied above @classmethod / @staticmethod: lock the function inside.
            return type(func)(decorate(func.__func__))
        if not callable(func):
            raise LockArgumentError(f"locked() decorates a function, got {func!r}")
        _refuse_unsupported(func)
        make_keys, handler = _prepared(spec, func, on_busy)

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            keys = make_keys(args, kwargs)
            manager = resolve()
            held: HeldLock | HeldLocks
            try:
                held = _acquirer(manager, keys, fair)(keys, **options)
            except LockNotAcquired as exc:
                if handler is None:
                    raise
                return handler(exc, *args, **kwargs)  # type: ignore[no-any-return]
            if defer is not None:
                return call_deferring(held, defer, func, args, kwargs)
            with held:
                result = func(*args, **kwargs)
                if inspect.isawaitable(result):
                    _refuse_awaitable(func, result)
                return result

        return wrapper

    return decorate


def _prepared(
    spec: KeySpec, func: Callable[..., Any], on_busy: OnBusy
) -> tuple[KeysOf, BusyHandler | None]:
    """What both faces' decorators make of a function when they decorate it:
    what builds its keys from a call, and its busy handler (checked now)."""
    make_keys = _key_builder(spec, func)
    handler = None if on_busy == "raise" else on_busy
    if handler is not None:
        _check_handler(handler, func)
    return make_keys, handler


def _acquirer(
    manager: Acquirer | AsyncAcquirer, keys: str | tuple[str, ...], fair: bool
) -> Callable[..., Any]:
    """What takes a call's key (``acquire``) or keys (``acquire_many``: not
    with ``fair``) on either face's manager."""
    if isinstance(keys, str):
        return manager.acquire
    if fair:
        raise LockArgumentError("fair=True takes one key per call, not several")
    return manager.acquire_many


def _fair_option(options: dict[str, Any], fair: object, spec: KeySpec) -> None:
    """``fair=True`` (the fair queue) takes one key per call."""
    if fair is False:
        return
    if fair is not True:
        raise LockArgumentError(f"fair must be True or False, got {fair!r}")
    if not isinstance(spec, str) and not callable(spec):
        raise LockArgumentError("fair=True takes one key per call, not a list of keys")
    options["fair"] = True


def _checked_options(given: Mapping[str, Any], on_busy: object) -> dict[str, Any]:
    """Check a decorator's options now, when it is applied."""
    lock_args(given)
    blocking = given.get("blocking", True)
    timeout = given.get("timeout", UNSET)
    ttl = given.get("ttl")
    renew = given.get("renew")
    max_hold = given.get("max_hold")
    on_lost = given.get("on_lost")
    if not isinstance(blocking, bool):
        raise LockArgumentError(f"blocking must be True or False, got {blocking!r}")
    if timeout is not UNSET:
        check_wait(blocking, check_timeout(timeout))
    if ttl is not None:
        check_lease(ttl)
    if renew is not None and not isinstance(renew, bool):
        raise LockArgumentError(f"renew must be True or False, got {renew!r}")
    check_max_hold(max_hold)
    check_on_lost(on_lost)
    if on_busy != "raise" and not callable(on_busy):
        raise LockArgumentError(
            f"on_busy must be 'raise' or a callable handler(error, *args, **kwargs) "
            f"(dblock.returns(value) returns a value), got {on_busy!r}"
        )
    return {
        "blocking": blocking,
        "timeout": timeout,
        "ttl": ttl,
        "renew": renew,
        "max_hold": max_hold,
        "on_lost": on_lost,
    }


def alocked(
    resolve: Callable[[], AsyncAcquirer],
    spec: KeySpec,
    *,
    on_busy: OnBusy = "raise",
    defer: DeferHook | None = None,
    fair: bool = False,
    **given: Unpack[LockArgs],
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """:func:`locked` for coroutine functions (``async def``), on an
    :class:`~dblock.AsyncLockManager`; ``on_busy`` may be a coroutine function.
    ``defer`` as for :func:`locked` (see :mod:`dblock.adeferral`)."""
    options = _checked_options(given, on_busy)
    _fair_option(options, fair, spec)

    def decorate(func: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        if isinstance(func, (classmethod, staticmethod)):
            return type(func)(decorate(func.__func__))
        if not inspect.iscoroutinefunction(func):
            name = getattr(func, "__qualname__", repr(func))
            raise LockArgumentError(
                f"{name} is not a coroutine function (async def): use LockManager.locked "
                "for plain functions"
            )
        make_keys, handler = _prepared(spec, func, on_busy)

        @functools.wraps(func)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            keys = make_keys(args, kwargs)
            manager = resolve()
            try:
                held: Any = await _acquirer(manager, keys, fair)(keys, **options)
            except LockNotAcquired as exc:
                if handler is None:
                    raise
                result = handler(exc, *args, **kwargs)
                if inspect.isawaitable(result):
                    result = await result
                return result  # type: ignore[no-any-return]
            if defer is not None:
                return await acall_deferring(held, defer, func, args, kwargs)
            async with held:
                return await func(*args, **kwargs)

        return wrapper

    return decorate


def _refuse_unsupported(func: Callable[..., Any]) -> None:
    name = getattr(func, "__qualname__", repr(func))
    if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
        raise LockArgumentError(
            f"{name} is a coroutine function: this synchronous decorator would release the "
            "lock before its body runs; use the async form (dblock's asyncio API, "
            "`async with`) for coroutines"
        )
    if inspect.isgeneratorfunction(func):
        raise LockArgumentError(
            f"{name} is a generator function: the lock would be released before its body "
            "runs; lock inside the generator with `with locks.lock(...)` instead"
        )


def _refuse_awaitable(func: Callable[..., Any], result: object) -> None:
    """The call returned an awaitable (an ``async def`` behind a plain
    wrapper): its work has not run yet, and must not run after the lock is
    released. Refuse it (the ``with`` around us releases the lock) and close
    a coroutine so it does not warn that it was never awaited."""
    close = getattr(result, "close", None)
    if callable(close):
        close()
    name = getattr(func, "__qualname__", repr(func))
    raise LockArgumentError(
        f"{name} returned {type(result).__name__} {result!r}, an awaitable: its work would run "
        "after this synchronous lock is released; use the async form (dblock's asyncio API, "
        "`async with`) to lock coroutines"
    )


KeysOf = Callable[[tuple[Any, ...], dict[str, Any]], str | tuple[str, ...]]


def _key_builder(spec: KeySpec, func: Callable[..., Any]) -> KeysOf:
    """What turns a call's arguments into its key (a str) or keys (ordered)."""
    if isinstance(spec, str):
        return KeyTemplate(spec, func)
    if callable(spec):
        make = spec
        name = getattr(spec, "__qualname__", repr(spec))

        def from_callable(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | tuple[str, ...]:
            made = make(*args, **kwargs)
            if isinstance(made, str):
                return check_key(made)
            try:
                return order_keys(made)
            except LockArgumentError as exc:
                raise LockArgumentError(
                    f"the key function {name} returned {made!r}: {exc}"
                ) from exc

        return from_callable
    if isinstance(spec, Sequence) and spec and all(isinstance(s, str) for s in spec):
        templates = [KeyTemplate(s, func) for s in spec]
        return lambda args, kwargs: order_keys(t(args, kwargs) for t in templates)
    raise LockArgumentError(
        "the key must be a format string, a non-empty list of format strings, or a callable "
        f"returning a key or keys; got {spec!r}"
    )


def _check_handler(handler: BusyHandler, func: Callable[..., Any]) -> None:
    """Refuse, now, a handler that could not take ``(error, *args, **kwargs)``."""
    try:
        handler_sig = inspect.signature(handler)
        func_sig = inspect.signature(func)
    except (TypeError, ValueError):
        return  # no introspectable signature (some builtins): trust it
    args: list[Any] = [None]
    kwargs: dict[str, Any] = {}
    for p in func_sig.parameters.values():
        if p.default is not p.empty:
            continue  # a call may leave it out
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            args.append(None)
        elif p.kind is p.KEYWORD_ONLY:
            kwargs[p.name] = None
    try:
        handler_sig.bind(*args, **kwargs)
    except TypeError as exc:
        name = getattr(handler, "__qualname__", repr(handler))
        raise LockArgumentError(
            f"on_busy handler {name}{handler_sig} cannot be called as handler(error, *args, "
            f"**kwargs) with the arguments of {getattr(func, '__qualname__', func)}{func_sig}: "
            f"{exc}"
        ) from exc
