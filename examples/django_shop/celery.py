# examples/django_shop/celery.py
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "examples.django_shop.settings")

app = Celery("django_shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()  # the apps' tasks.py: idemmail's send_email, send_campaign and the outbox relay
