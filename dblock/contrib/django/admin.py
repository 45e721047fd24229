"""A read-only admin page of the locks held now, with a force-release action."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone

from ...errors import DBLockError
from .. import _admin
from . import conf, get_manager
from .models import Lock


@admin.register(Lock)
class LockAdmin(admin.ModelAdmin):
    list_display = ("lock_key", "owner", "fence", "acquired_at", "expires_at", "lease")
    search_fields = ("lock_key", "owner")
    readonly_fields = ("lock_key", "owner", "fence", "acquired_at", "expires_at")
    exclude = ("token",)  # what release matches on: not for display
    actions = ("force_release",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Lock]:
        return super().get_queryset(request).using(conf.database_alias())

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # a plain DELETE would not wake PostgreSQL waiters: force-release does

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("dblock.force_release_lock"))

    @admin.display(description="lease left")
    def lease(self, obj: Lock) -> str:
        left = (obj.expires_at - timezone.now()).total_seconds()  # this server's clock
        return "ended" if left <= 0 else f"{left:.0f} s"

    @admin.action(description="Force-release the selected locks", permissions=["force_release"])
    def force_release(self, request: HttpRequest, queryset: QuerySet[Lock]) -> None:
        manager = get_manager()
        released = []
        try:
            for key in queryset.values_list("lock_key", flat=True):
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
