"""The same withdrawal as an async view: ``locked_view`` on ``async def``.

Async views run on the event loop (under an ASGI server: ``uvicorn
exampleproject.asgi:application``); their locks are taken without blocking
it, and share the process's level 1 with the synchronous views' threads.
Django refuses ``ATOMIC_REQUESTS`` for async views: each ORM call below
commits on its own, so the balance update commits inside the lock.
"""

import asyncio
import json

from django.db import transaction
from django.http import Http404, HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from dblock.contrib.django import locked, locked_view

from .models import Account


async def account_or_404(user_id: int) -> Account:
    try:
        return await Account.objects.aget(pk=user_id)
    except Account.DoesNotExist:
        raise Http404("no such account") from None


async def pay_out(user_id: int, amount: int) -> None:
    """The slow part of a withdrawal: a payment provider's API, say."""
    await asyncio.sleep(0.02)


@locked("user:{user_id}", timeout=30)
async def withdraw(user_id: int, amount: int) -> int | None:
    """Read, check and write a balance, one request per user at a time."""
    account = await account_or_404(user_id)
    if amount > account.balance:
        return None
    await pay_out(user_id, amount)
    account.balance -= amount
    await account.asave(update_fields=["balance"])
    return account.balance


@transaction.non_atomic_requests
@csrf_exempt
@require_POST
async def withdraw_view(request: HttpRequest, user_id: int) -> JsonResponse:
    amount = int(json.loads(request.body)["amount"])
    balance = await withdraw(user_id, amount)
    if balance is None:
        return JsonResponse({"error": "insufficient funds"}, status=400)
    return JsonResponse({"user_id": user_id, "balance": balance})


@transaction.non_atomic_requests
@require_GET
@locked_view("user:{user_id}", blocking=False)  # busy: 409 from the decorator
async def balance_view(request: HttpRequest, user_id: int) -> JsonResponse:
    account = await account_or_404(user_id)
    return JsonResponse({"user_id": user_id, "balance": account.balance})
