"""Lock keys: what a valid key is, and keys built from a call's arguments.

A key is a non-empty ``str`` of at most 255 characters after Unicode NFC
normalisation (so ``"café"`` typed two ways is one lock), without NUL (which
PostgreSQL cannot store), and valid Unicode text: a lone surrogate (what
``json.loads('"\\ud800"')`` or a non-UTF-8 command-line byte gives) cannot be
encoded for any database. Keys are always sent as bound parameters.
"""

from __future__ import annotations

import inspect
import string
import unicodedata
from collections.abc import Callable
from typing import Any

from .errors import LockArgumentError

__all__ = ["MAX_KEY_LENGTH", "KeyTemplate", "check_filter", "check_key", "check_text", "db_text"]

MAX_KEY_LENGTH = 255


def check_key(key: object) -> str:
    """Return the normalised key, or raise :class:`LockArgumentError`."""
    if type(key) is not str:
        if not isinstance(key, str):
            raise LockArgumentError(f"lock key must be a str, got {type(key).__name__} {key!r}")
        key = str(key)  # a str subclass: store the plain value
    if not key.isascii():
        # Before any SQL: the driver would fail to encode it, after the
        # statement was begun (and the outcome would look unknown).
        check_text(key, "lock key")
        if not unicodedata.is_normalized("NFC", key):
            key = unicodedata.normalize("NFC", key)
    if not key:
        raise LockArgumentError("lock key must not be empty")
    if len(key) > MAX_KEY_LENGTH:
        raise LockArgumentError(
            f"lock key is {len(key)} characters long, the limit is {MAX_KEY_LENGTH}: "
            f"{key[:40]!r}..."
        )
    if "\x00" in key:
        raise LockArgumentError(f"lock key must not contain NUL characters: {key!r}")
    return key


def check_filter(option: str, value: object) -> str:
    """A ``--prefix`` or ``--owner`` value of the admin commands, checked as a
    key is (the same rules and messages, naming ``option``): not empty, at
    most :data:`MAX_KEY_LENGTH` characters, storable text."""
    try:
        return check_key(value)
    except LockArgumentError as exc:
        raise LockArgumentError(str(exc).replace("lock key", option, 1)) from None


def check_text(text: str, what: str) -> None:
    """Raise :class:`LockArgumentError` unless ``text`` can be encoded as UTF-8
    (it can, unless it holds a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise LockArgumentError(
            f"{what} is not valid Unicode text: {text!r} holds the lone surrogate "
            f"{text[exc.start]!r} at position {exc.start} (undecodable input, such as "
            "a non-UTF-8 byte or a broken JSON escape), which no database can store"
        ) from None


def db_text(text: str) -> str:
    """``text`` with anything a database cannot store (lone surrogates)
    replaced by ``?``: for labels dblock writes, such as a thread's name."""
    if text.isascii():
        return text
    return text.encode("utf-8", "replace").decode("utf-8")


class KeyTemplate:
    """Builds a lock key from the arguments of a call.

    ``template`` is either a format string whose fields name the function's
    parameters (``"user:{user_id}"``, ``"order:{order.id}"``,
    ``"transfer:{src.id}:{dst.id}"``) or a callable taking the same arguments as
    the function and returning the key. Field names are checked against the
    signature when the template is made, so a typo fails at import time.
    """

    __slots__ = ("_callable", "_signature", "_template", "fields")

    def __init__(self, template: str | Callable[..., str], func: Callable[..., Any]) -> None:
        self._signature = inspect.signature(func)
        self._callable: Callable[..., str] | None = None
        self._template = ""
        self.fields: tuple[str, ...] = ()
        if callable(template):
            self._callable = template
            return
        if not isinstance(template, str) or not template:
            raise LockArgumentError(
                f"key template must be a non-empty format string or a callable, got {template!r}"
            )
        self._template = template
        self.fields = _template_fields(template)
        params = self._signature.parameters
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
        name = getattr(func, "__qualname__", repr(func))
        for field in self.fields:
            if field not in params and not takes_kwargs:
                raise LockArgumentError(
                    f"key template {template!r} names {field!r}, which is not a parameter of "
                    f"{name}{self._signature}"
                )

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        if self._callable is not None:
            return check_key(self._callable(*args, **kwargs))
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        for p in self._signature.parameters.values():
            if p.kind is p.VAR_KEYWORD and p.name in values:
                values.update(values.pop(p.name))
        try:
            key = self._template.format_map(values)
        except (AttributeError, KeyError, IndexError, TypeError, ValueError) as exc:
            raise LockArgumentError(
                f"cannot build lock key from template {self._template!r}: {exc}"
            ) from exc
        return check_key(key)


def _template_fields(template: str) -> tuple[str, ...]:
    """The top-level argument names a format string uses."""
    names: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise LockArgumentError(f"bad key template {template!r}: {exc}") from exc
    for _, field, _, _ in parsed:
        if field is None:
            continue
        head = field.split(".", 1)[0].split("[", 1)[0]
        if not head or head.isdigit():
            raise LockArgumentError(
                f"key template {template!r} must name arguments ({{user_id}}), "
                "not positions ({} or {0})"
            )
        if head not in names:
            names.append(head)
    if not names:
        raise LockArgumentError(
            f"key template {template!r} names no argument; every call would share one lock. "
            "Use lock() with a fixed key if that is what you want."
        )
    return tuple(names)
