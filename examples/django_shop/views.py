# examples/django_shop/views.py
from django.contrib.auth.models import User
from django.core.mail import send_mail
from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from idemmail_celery import InvalidEmail
from idemmail_celery.contrib.django.outbox import enqueue_email

from .models import Order


class OutOfStock(Exception):
    pass


class TermsDeclined(Exception):
    pass


@csrf_exempt  # an API called by the shop's front end with its own token; a form view keeps CSRF on
@require_POST
def create_order(request: HttpRequest) -> JsonResponse:
    """The order and its confirmation email commit together, or neither does."""
    try:
        with transaction.atomic():
            order = Order.objects.create(email=request.POST["email"], total_cents=int(request.POST["total_cents"]))
            enqueue_email(  # an INSERT in this transaction: InvalidEmail raises here, before any SQL
                to=order.email, subject=f"Order {order.pk} confirmed", html=f"<p>Thanks for order {order.pk}.</p>",
                event_id=f"order-{order.pk}", template="order_confirmation",
            )
            if request.POST.get("out_of_stock"):
                raise OutOfStock  # the order and its email intent roll back together
    except InvalidEmail as exc:
        return JsonResponse({"error": "InvalidEmail", "field": exc.field}, status=400)
    except OutOfStock:
        return JsonResponse({"error": "out of stock"}, status=409)
    return JsonResponse({"order_id": order.pk}, status=201)


@csrf_exempt
@require_POST
def sign_up(request: HttpRequest) -> JsonResponse:
    """An account and its welcome email, through Django's send_mail (EMAIL_BACKEND) in the same transaction.

    Posted twice, the form finds the account and sends the same email: one intent, one email.
    """
    address = request.POST["email"]
    try:
        with transaction.atomic():
            user, _ = User.objects.get_or_create(username=address, defaults={"email": address})
            send_mail("Welcome to the shop", f"Your account is {user.username}.", None, [user.email])
            if request.POST.get("decline_terms"):
                raise TermsDeclined  # the account and its email roll back together
    except InvalidEmail as exc:  # raised by send_mail, before anything is written
        return JsonResponse({"error": "InvalidEmail", "field": exc.field}, status=400)
    except TermsDeclined:
        return JsonResponse({"error": "terms declined"}, status=409)
    return JsonResponse({"user_id": user.pk}, status=201)
