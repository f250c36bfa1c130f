"""A minimal Django project using idemmail-celery: an order and its confirmation email in one
transaction (the outbox), send_email registered on the project's Celery app, the review queue in
the admin. The files are the code blocks of docs/django.md; tests/integration/test_django.py runs them."""

# Django's usual Celery layout: the app is created (and made current) when Django loads the project.
from .celery import app as celery_app

__all__ = ["celery_app"]
