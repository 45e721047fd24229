from accounts import async_views, views
from django.contrib import admin
from django.urls import path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("users/<int:user_id>/withdraw", views.withdraw),
    path("users/<int:user_id>/balance", views.balance),
    path("async/users/<int:user_id>/withdraw", async_views.withdraw_view),
    path("async/users/<int:user_id>/balance", async_views.balance_view),
]
