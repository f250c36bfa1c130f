# examples/django_shop/urls.py
from django.contrib import admin
from django.urls import include, path

from . import views

urlpatterns = [
    path("admin/", admin.site.urls),  # the review queue: Admin > Email intents > ledger records
    path("accounts/", include("django.contrib.auth.urls")),  # PasswordResetView's email: EMAIL_BACKEND
    path("orders", views.create_order),
    path("sign-up", views.sign_up),
]
