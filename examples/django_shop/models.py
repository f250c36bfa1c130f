# examples/django_shop/models.py
from django.db import models


class Order(models.Model):
    email = models.CharField(max_length=254)
    total_cents = models.IntegerField()
