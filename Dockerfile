# One image for every Crucible service: `python -m crucible.services.<name>` picks the service.
FROM python:3.11-slim
WORKDIR /app
COPY requirements.lock .
RUN pip install --no-cache-dir -r requirements.lock
COPY . .
RUN pip install --no-cache-dir --no-deps -e .
ENV CRUCIBLE_GRPC_HOST=0.0.0.0
USER 10001
