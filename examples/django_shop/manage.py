# examples/django_shop/manage.py
import os
import sys
from pathlib import Path


def main() -> None:
    # The repository root, where `examples` is, instead of this directory (whose celery.py is not Celery).
    sys.path[0] = str(Path(__file__).resolve().parents[2])
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "examples.django_shop.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
