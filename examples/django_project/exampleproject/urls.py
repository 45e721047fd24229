from accounts import views
from django.contrib import admin
from django.urls import path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("users/<int:user_id>/withdraw", views.withdraw),
    path("users/<int:user_id>/balance", views.balance),
]
