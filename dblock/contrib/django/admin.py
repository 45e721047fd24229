"""A read-only admin page of the locks held now, with a force-release action.

What an operator asks of it: which keys of one kind are held (the key prefix
filter, from the part of each key before its first ``:``), which rows expired
without being released (the lease filter: crashed holders the sweeper has not
reached), and which have been held for long (the age filter and column).
Above the list, the table's storage as ``dblock stats`` shows it (size, dead
rows and autovacuum on PostgreSQL, purge lag on MariaDB/MySQL), as a warning
when vacuum does not keep up (docs/operations.md, "Vacuum and bloat").
Above the list too, each role's leader now (``dblock lead``,
``LockManager.leader``); the "held as" filter shows only leaders, job runs
or other locks. Ages and leases in the list use this web server's clock, not
the database's: the ``dblock list`` and ``dblock top`` commands read both
from the database.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, ClassVar

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html

from ...errors import DBLockError
from ...jobs import JOB_PREFIX
from ...leader import LEADER_PREFIX, leaders_of
from .. import _admin
from . import conf, get_manager
from .models import JobRun, Lock

#: How many roles' leaders the list names above it at most.
_LEADERS = 20
#: How many distinct key prefixes the prefix filter offers at most.
_PREFIXES = 50
#: How many keys it reads to find them (the table may hold many more).
_PREFIX_SAMPLE = 5000


class LeaseFilter(admin.SimpleListFilter):
    title = "lease"
    parameter_name = "lease"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("live", "live"), ("expired", "expired (not released)")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Lock]) -> QuerySet[Lock]:
        now = timezone.now()
        if self.value() == "expired":
            return queryset.filter(expires_at__lte=now)
        if self.value() == "live":
            return queryset.filter(expires_at__gt=now)
        return queryset


class AgeFilter(admin.SimpleListFilter):
    title = "held for"
    parameter_name = "held"
    _SPANS: ClassVar[dict[str, tuple[str, timedelta]]] = {
        "1m": ("over a minute", timedelta(minutes=1)),
        "10m": ("over 10 minutes", timedelta(minutes=10)),
        "1h": ("over an hour", timedelta(hours=1)),
        "1d": ("over a day", timedelta(days=1)),
    }

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(value, label) for value, (label, _) in self._SPANS.items()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Lock]) -> QuerySet[Lock]:
        span = self._SPANS.get(self.value() or "")
        if span is None:
            return queryset
        return queryset.filter(acquired_at__lte=timezone.now() - span[1])


class KeyPrefixFilter(admin.SimpleListFilter):
    """Keys by their namespace: ``user:`` for ``user:42``, ``order:`` for ``order:9001``."""

    title = "key prefix"
    parameter_name = "prefix"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        keys = model_admin.get_queryset(request).values_list("lock_key", flat=True)
        prefixes = sorted({key.split(":", 1)[0] + ":" for key in keys[:_PREFIX_SAMPLE]})
        return [(prefix, prefix) for prefix in prefixes[:_PREFIXES]]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Lock]) -> QuerySet[Lock]:
        prefix = self.value()
        return queryset.filter(lock_key__startswith=prefix) if prefix else queryset


class HeldAsFilter(admin.SimpleListFilter):
    """What a row is held as: a role's leadership (``leader:<role>``), a
    job's run (``job:<name>``) or any other lock."""

    title = "held as"
    parameter_name = "as"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("leader", "a role's leader"), ("job", "a job's run"), ("lock", "a lock")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Lock]) -> QuerySet[Lock]:
        if self.value() == "leader":
            return queryset.filter(lock_key__startswith=LEADER_PREFIX)
        if self.value() == "job":
            return queryset.filter(lock_key__startswith=JOB_PREFIX)
        if self.value() == "lock":
            return queryset.exclude(lock_key__startswith=LEADER_PREFIX).exclude(
                lock_key__startswith=JOB_PREFIX
            )
        return queryset


@admin.register(Lock)
class LockAdmin(admin.ModelAdmin):
    list_display = (
        "lock_key",
        "kind",
        "mode",
        "slot",
        "owner",
        "fence",
        "held_for",
        "lease",
        "acquired_at",
        "expires_at",
    )
    list_filter = (HeldAsFilter, KeyPrefixFilter, "kind", LeaseFilter, AgeFilter)
    search_fields = ("lock_key", "owner")
    readonly_fields = (
        "lock_key",
        "kind",
        "mode",
        "slot",
        "holders",
        "permits",
        "owner",
        "fence",
        "acquired_at",
        "expires_at",
    )
    exclude = ("token",)  # what release matches on: not for display
    actions = ("force_release",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Lock]:
        return super().get_queryset(request).using(conf.database_alias())

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> Any:
        if request.method == "GET":
            self._leader_messages(request)
            self._storage_messages(request)
        return super().changelist_view(request, extra_context)

    def _leader_messages(self, request: HttpRequest) -> None:
        """Who leads each role now, read with the database's clock (as
        ``dblock stats`` names them): a line per role, at most 20."""
        try:
            rows = get_manager().store.rows(prefix=LEADER_PREFIX, limit=_LEADERS)
        except DBLockError:
            return  # the list itself says whether the database answers
        for row in leaders_of(rows):
            self.message_user(
                request,
                f"Leader of {row.key[len(LEADER_PREFIX) :]!r}: {row.owner}, term {row.fence}, "
                f"for {_span(row.age)} (lease left {_span(row.lease_left)}).",
                messages.INFO,
            )

    def _storage_messages(self, request: HttpRequest) -> None:
        try:
            table = get_manager().store.table_health()
        except DBLockError:
            return  # the list itself says whether the database answers
        if table is None:
            return
        line = table.summary()
        if line:
            self.message_user(request, f"Lock table: {line}.", messages.INFO)
        for warning in table.warnings:
            self.message_user(request, f"Lock table: {warning}.", messages.WARNING)

    def get_object(self, request: HttpRequest, object_id: str, from_field: Any = None) -> Any:
        # A key may have several rows (semaphore permits, read-write rows):
        # the page of a key shows its first row; the list shows them all.
        queryset = self.get_queryset(request)
        field = (
            self.model._meta.pk if from_field is None else self.model._meta.get_field(from_field)
        )
        try:
            value = field.to_python(object_id)
        except Exception:  # what ModelAdmin.get_object does with a malformed id
            return None
        return queryset.filter(**{field.name: value}).order_by("slot").first()

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # a plain DELETE would not wake PostgreSQL waiters: force-release does

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("dblock.force_release_lock"))

    @admin.display(description="held for", ordering="acquired_at")
    def held_for(self, obj: Lock) -> str:
        return _span((timezone.now() - obj.acquired_at).total_seconds())

    @admin.display(description="lease left", ordering="expires_at")
    def lease(self, obj: Lock) -> str:
        left = (obj.expires_at - timezone.now()).total_seconds()  # this server's clock
        if left <= 0:
            marked: str = format_html(
                '<strong style="color:#ba2121">expired {} ago</strong>', _span(-left)
            )
            return marked
        return _span(left)

    @admin.action(
        description="Force-release the selected locks (every row of their keys)",
        permissions=["force_release"],
    )
    def force_release(self, request: HttpRequest, queryset: QuerySet[Lock]) -> None:
        manager = get_manager()
        released = []
        try:
            for key in sorted(set(queryset.values_list("lock_key", flat=True))):
                if _admin.force_release(manager, key):
                    released.append(key)
        except DBLockError as exc:
            self.message_user(request, f"force-release failed: {exc}", messages.ERROR)
            return
        self.message_user(
            request,
            f"Released {len(released)} lock(s): {', '.join(released) or 'none were held'}. "
            "Their holders were not told and run on without mutual exclusion.",
            messages.WARNING,
        )


@admin.register(JobRun)
class JobRunAdmin(admin.ModelAdmin):
    """The record of job runs, newest first: who ran which fire time, how it
    ended and how long it took (database times, as recorded). Read-only."""

    list_display = (
        "job",
        "fire_time",
        "outcome",
        "runner",
        "started_at",
        "duration",
        "attempt",
        "detail",
        "next_fire",
    )
    list_filter = ("outcome", "job")
    search_fields = ("job", "runner")
    date_hierarchy = None
    readonly_fields = (
        "job",
        "fire_time",
        "outcome",
        "detail",
        "runner",
        "started_at",
        "finished_at",
        "attempt",
        "next_fire",
    )
    exclude = ("token",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[JobRun]:
        return super().get_queryset(request).using(conf.database_alias())

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # the sweeper prunes runs after their retention

    @admin.display(description="duration", ordering="finished_at")
    def duration(self, obj: JobRun) -> str:
        finished: datetime | None = getattr(obj, "finished_at", None)  # NULL while running
        if finished is None:
            return "-"
        return _span((finished - obj.started_at).total_seconds())


def _span(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"
