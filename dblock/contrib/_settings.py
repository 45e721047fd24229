"""The settings both integrations read: Flask's ``DBLOCK_*`` keys and Django's
``DBLOCK`` dict use the same names (``URL``, ``TABLE``, ``TTL``, ...).

Every :class:`~dblock.Config` field is a setting under its upper-case name;
the others are listed in :data:`COMMON`. An unknown name is refused with the
list of known ones, so a typo fails at start-up instead of being ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from ..config import Config, check_ttl
from ..errors import LockArgumentError
from ._http import check_busy_status

__all__ = ["COMMON", "Settings", "read_settings"]

#: Settings that are not Config fields, with their defaults.
COMMON: Mapping[str, Any] = {
    "URL": None,
    "ENGINE_OPTIONS": None,
    "SWEEPER": False,
    "SWEEPER_INTERVAL": 60.0,
    "SWEEPER_MAX_AGE": None,
    "BUSY_STATUS": 409,
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """What an integration needs to build its manager and behave."""

    url: str | None
    engine_options: Mapping[str, Any] | None
    config: Config
    sweeper: bool
    sweeper_interval: float
    sweeper_max_age: float | None
    busy_status: int
    #: The integration's own settings (defaults applied).
    extra: Mapping[str, Any]


def read_settings(
    values: Mapping[str, Any],
    *,
    name: Callable[[str], str],
    extra: Mapping[str, Any] | None = None,
) -> Settings:
    """``values`` (names without prefix) checked and turned into :class:`Settings`.
    ``name(key)`` spells a setting the way the user wrote it, for messages."""
    extra = extra or {}
    fields = {f.name.upper(): f.name for f in dataclasses.fields(Config)}
    known = set(fields) | set(COMMON) | set(extra)
    unknown = sorted(set(values) - known)
    if unknown:
        raise LockArgumentError(
            f"unknown dblock setting{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(name(k) for k in unknown)}; known: {', '.join(sorted(known))}"
        )
    try:
        config = Config(**{fields[k]: v for k, v in values.items() if k in fields})
    except LockArgumentError as exc:
        raise LockArgumentError(f"bad dblock setting: {exc}") from exc
    merged = {**COMMON, **extra, **values}
    url = merged["URL"]
    if url is not None and not isinstance(url, str):
        raise LockArgumentError(f"{name('URL')} must be a database URL string, got {url!r}")
    options = merged["ENGINE_OPTIONS"]
    if options is not None and not isinstance(options, Mapping):
        raise LockArgumentError(f"{name('ENGINE_OPTIONS')} must be a dict, got {options!r}")
    for flag in ("SWEEPER",):
        if not isinstance(merged[flag], bool):
            raise LockArgumentError(f"{name(flag)} must be True or False, got {merged[flag]!r}")
    max_age = merged["SWEEPER_MAX_AGE"]
    return Settings(
        url=url,
        engine_options=options,
        config=config,
        sweeper=merged["SWEEPER"],
        sweeper_interval=check_ttl(merged["SWEEPER_INTERVAL"], name("SWEEPER_INTERVAL")),
        sweeper_max_age=None if max_age is None else check_ttl(max_age, name("SWEEPER_MAX_AGE")),
        busy_status=check_busy_status(merged["BUSY_STATUS"], name("BUSY_STATUS")),
        extra={k: merged[k] for k in extra},
    )
