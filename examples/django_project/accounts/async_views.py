"""The same withdrawal as an async view: ``locked_view`` on ``async def``.

Async views run on the event loop (under an ASGI server: ``uvicorn
exampleproject.asgi:application``); their locks are taken without blocking
it, and share the process's level 1 with the synchronous views' threads.
Django refuses ``ATOMIC_REQUESTS`` for async views: each ORM call below
commits on its own, so the balance update commits inside the lock.
"""

import asyncio
import json
import uuid

from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from dblock.contrib.django import locked, locked_view

from .models import Account, Ledger


@locked("user:{user_id}", timeout=30)
async def withdraw(user_id: int, amount: int, request_id: str) -> int | None:
    """Read, check and write a balance, one request per user at a time."""
    await Ledger.objects.acreate(user_id=user_id, request_id=request_id, event="enter")
    account = await Account.objects.aget(pk=user_id)
    balance = account.balance
    await asyncio.sleep(0.02)  # the slow part: a payment provider, say
    if amount <= balance:
        account.balance = balance - amount
        await account.asave(update_fields=["balance"])
    await Ledger.objects.acreate(user_id=user_id, request_id=request_id, event="exit")
    return account.balance if amount <= balance else None


@transaction.non_atomic_requests
@csrf_exempt
@require_POST
async def withdraw_view(request: HttpRequest, user_id: int) -> JsonResponse:
    amount = int(json.loads(request.body)["amount"])
    balance = await withdraw(user_id, amount, uuid.uuid4().hex)
    if balance is None:
        return JsonResponse({"error": "insufficient funds"}, status=400)
    return JsonResponse({"user_id": user_id, "balance": balance})


@transaction.non_atomic_requests
@require_GET
@locked_view("user:{user_id}", blocking=False)  # busy: 409 from the decorator
async def balance_view(request: HttpRequest, user_id: int) -> JsonResponse:
    account = await Account.objects.aget(pk=user_id)
    return JsonResponse({"user_id": user_id, "balance": account.balance})
