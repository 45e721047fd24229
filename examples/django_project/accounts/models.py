from django.db import models


class Account(models.Model):
    balance = models.IntegerField()


class Ledger(models.Model):
    """Who entered and left the critical section, in order (the tests read it)."""

    user_id = models.IntegerField()
    request_id = models.CharField(max_length=32)
    event = models.CharField(max_length=5)
