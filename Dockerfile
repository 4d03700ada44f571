# One image for every Crucible service: `python -m crucible.services.<name>` picks the service.
FROM python:3.11-slim

# The services run as uid 10001 (the k8s manifests' runAsUser). HOME and CRUCIBLE_HOME are set
# explicitly: checkpoints go to $CRUCIBLE_HOME/runs/<run_id>/checkpoints, and compose and k8s
# mount the shared checkpoint volume exactly at CRUCIBLE_HOME (tests/test_deploy_files.py).
# CRUCIBLE_HOME is Settings.home's default for this HOME, so every process in the image agrees.
ENV HOME=/home/crucible \
    CRUCIBLE_HOME=/home/crucible/.cache/crucible \
    CRUCIBLE_GRPC_HOST=0.0.0.0 \
    PYTHONUNBUFFERED=1
RUN groupadd --gid 10001 crucible \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/crucible --shell /usr/sbin/nologin crucible \
    && install -d -o 10001 -g 10001 /home/crucible/.cache /home/crucible/.cache/crucible

WORKDIR /src
COPY requirements.lock .
RUN pip install --no-cache-dir -r requirements.lock

# What setup.py maps into the `crucible` namespace (crucible.v1 <- protos/crucible/v1,
# crucible.shared <- shared/, crucible.ml <- ml/, crucible.services <- services/,
# crucible.local <- local/, crucible.cli <- cli/), plus what the build reads.
COPY pyproject.toml setup.py README.md ./
COPY protos/ protos/
COPY shared/ shared/
COPY ml/ ml/
COPY services/ services/
COPY local/ local/
COPY cli/ cli/
COPY recipes/ recipes/
COPY dashboards/ dashboards/
# A regular (not editable) install: the services run from site-packages, and the source copy is
# removed so that no top-level `shared`/`services` folder can shadow the installed package.
RUN pip install --no-cache-dir --no-deps . \
    && cd / && rm -rf /src \
    && python -c "import crucible.v1, crucible.shared.settings, crucible.ml, crucible.services, crucible.local, crucible.cli"

USER 10001
# Anything a service writes relative to its working directory lands under CRUCIBLE_HOME too.
WORKDIR /home/crucible/.cache/crucible
