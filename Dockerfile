FROM python:3.11-slim
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir '.[kafka]' \
    && useradd --system --uid 10001 --user-group --create-home --home-dir /home/outbox outbox
ENV PYTHONUNBUFFERED=1 \
    OUTBOX_HOME=/home/outbox/.outbox
# Never root: a deliverer runs sink code and holds credentials. A numeric user
# lets Kubernetes check runAsNonRoot. Give the DSN as a secret file
# (OUTBOX_DSN_FILE=/run/secrets/outbox_dsn) or OUTBOX_DSN, never with --dsn.
USER 10001:10001
CMD ["outbox", "--help"]
