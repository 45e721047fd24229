import json

from django.http import HttpRequest, JsonResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from dblock.contrib.django import locked_view

from .models import Account
from .services import withdraw as withdraw_service


@csrf_exempt
@require_POST
def withdraw(request: HttpRequest, user_id: int) -> JsonResponse:
    amount = int(json.loads(request.body)["amount"])
    balance = withdraw_service(user_id, amount)
    if balance is None:
        return JsonResponse({"error": "insufficient funds"}, status=400)
    return JsonResponse({"user_id": user_id, "balance": balance})


@require_GET
@locked_view("user:{user_id}", blocking=False)  # busy: 409 from the decorator
def balance(request: HttpRequest, user_id: int) -> JsonResponse:
    account = get_object_or_404(Account, pk=user_id)
    return JsonResponse({"user_id": user_id, "balance": account.balance})
