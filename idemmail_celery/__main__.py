"""``python -m idemmail_celery ...``: the operator CLI without Celery's own command."""

from .cli import main

main()
