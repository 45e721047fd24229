"""``MIDDLEWARE = [..., "dblock.contrib.django.middleware.LockBusyMiddleware"]``"""

from __future__ import annotations

from .views import LockBusyMiddleware

__all__ = ["LockBusyMiddleware"]
