# examples/django_shop/urls.py
from django.contrib import admin
from django.urls import path

from . import views

urlpatterns = [
    path("admin/", admin.site.urls),  # the review queue: Admin > Email intents > ledger records
    path("orders", views.create_order),
]
