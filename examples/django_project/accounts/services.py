"""The service layer: one withdrawal per user at a time, across every
worker process and server."""

import time

from django.shortcuts import get_object_or_404

from dblock.contrib.django import locked

from .models import Account


def pay_out(user_id: int, amount: int) -> None:
    """The slow part of a withdrawal: a payment provider's API, say."""
    time.sleep(0.02)


@locked("user:{user_id}", timeout=30)
def withdraw(user_id: int, amount: int) -> int | None:
    """Read, check and write a balance: right only if one request per user
    runs it at a time. Returns the new balance, or None if too low."""
    account = get_object_or_404(Account, pk=user_id)
    if amount > account.balance:
        return None
    pay_out(user_id, amount)
    account.balance -= amount
    account.save(update_fields=["balance"])
    return account.balance
