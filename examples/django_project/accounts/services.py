"""The service layer: one withdrawal per user at a time, across every
worker process and server."""

import time

from dblock.contrib.django import locked

from .models import Account, Ledger


@locked("user:{user_id}", timeout=30)
def withdraw(user_id: int, amount: int, request_id: str) -> int | None:
    """Read, check and write a balance: right only if one request per user
    runs it at a time. Returns the new balance, or None if too low."""
    Ledger.objects.create(user_id=user_id, request_id=request_id, event="enter")
    account = Account.objects.get(pk=user_id)
    balance = account.balance
    time.sleep(0.02)  # the slow part: a payment provider, say
    if amount <= balance:
        account.balance = balance - amount
        account.save(update_fields=["balance"])
    Ledger.objects.create(user_id=user_id, request_id=request_id, event="exit")
    return account.balance if amount <= balance else None
