# syntax=docker/dockerfile:1
# gpufail's images, both installed from requirements.lock (the versions the tests ran with):
#   docker build --target collector -t gpufail-collector .   # `gpufail collect` on GPU nodes
#   docker build --target full -t gpufail .                  # serve, nightly, train, publish, ...
# Both run as the unprivileged user gpufail (uid 10001) with `gpufail` as the entry point.
# deploy/README.md says how they are deployed.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS source
ARG UV_VERSION=0.13.9
RUN pip install --no-cache-dir "uv==${UV_VERSION}"
WORKDIR /src
COPY pyproject.toml requirements.lock README.md ./
COPY gpufail/ gpufail/
COPY ingest/ ingest/
COPY features/ features/
COPY models/ models/
COPY serving/ serving/
# The lock pins every package of every extra; each image installs only its extras' share.
# Compiled to bytecode at build: the runtime sets PYTHONDONTWRITEBYTECODE, so without it every
# process (each CLI command, each serving replica) compiles what it imports as it starts.
ENV UV_NO_CACHE=1 UV_LINK_MODE=copy UV_COMPILE_BYTECODE=1

FROM source AS build-collector
RUN uv venv --python /usr/local/bin/python3 /opt/gpufail \
 && uv pip install --python /opt/gpufail/bin/python --constraint requirements.lock ".[collect]"

FROM source AS build-full
RUN uv venv --python /usr/local/bin/python3 /opt/gpufail \
 && uv pip install --python /opt/gpufail/bin/python --constraint requirements.lock ".[collect,serve,train]"
# The feature kernels compiled into numba's cache now (gpufail/precompile.py), not by each fresh
# pod: a replica's or a nightly run's first feature read spent seconds compiling them.
ENV NUMBA_CACHE_DIR=/opt/gpufail-numba
RUN /opt/gpufail/bin/python -m gpufail.precompile

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 gpufail \
 && useradd --system --uid 10001 --gid gpufail --home-dir /var/lib/gpufail --create-home --shell /usr/sbin/nologin gpufail
ENV PATH=/opt/gpufail/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    MLFLOW_DISABLE_TELEMETRY=true \
    DO_NOT_TRACK=1
WORKDIR /var/lib/gpufail

FROM runtime AS collector
COPY --from=build-collector /opt/gpufail /opt/gpufail
USER 10001:10001
# [collect] listen: /metrics, /healthz, /readyz (set it to 0.0.0.0:9410 in a pod).
EXPOSE 9410
ENTRYPOINT ["gpufail"]
CMD ["collect"]

FROM runtime AS full
COPY --from=build-full /opt/gpufail /opt/gpufail
# numba uses a cache folder only where it can write: the runtime user's own copy. With a
# read-only root (the Kubernetes manifests), an init container copies it to an emptyDir that
# NUMBA_CACHE_DIR then names; with no writable folder at all the kernels compile uncached.
COPY --from=build-full --chown=10001:10001 /opt/gpufail-numba /opt/gpufail-numba
ENV NUMBA_CACHE_DIR=/opt/gpufail-numba
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["gpufail"]
CMD ["serve"]
