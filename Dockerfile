# The image behind compose.yaml's web, worker, beat, flower and mailcatcher services.
# CI runs this file's COPY and pip install lines in a fresh virtualenv (no Docker engine there).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml constraints.txt README.md LICENSE ./
COPY idemmail_celery ./idemmail_celery
COPY examples ./examples
RUN pip install --no-cache-dir -c constraints.txt -e ".[postgres,metrics]" Flask flower
ENV PYTHONPATH=/app PYTHONUNBUFFERED=1
