# syntax=docker/dockerfile:1
# Forgeline's processes for hosts of their own: one image per role, told apart by the extra it
# installs (pyproject.toml). Build from the repository root, the build context the wheel needs:
#
#   docker build -t forgeline-agent \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   # GPU hosts
#   docker build -t forgeline-control --build-arg FORGELINE_EXTRA=control .
#   docker build -t forgeline-data --build-arg FORGELINE_EXTRA=data .
#
# The agent's image has the base install only: no MLflow server, SQLAlchemy, DuckDB or Temporal
# binary. Not built in CI (no Docker engine there): tests/deploy/test_dockerfile.py checks what
# can be checked without one. The manifests under infra/deploy/ run these images.

ARG PYTHON_IMAGE=python:3.11-slim

# --- the wheel, built from the sources alone (no checkout's build/ leftovers) -----------------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY forgeline/ forgeline/
COPY infra/ infra/
COPY workflows/ workflows/
COPY activities/ activities/
COPY dataprep/ dataprep/
COPY trainer/ trainer/
COPY registry/ registry/
COPY worker/ worker/
RUN pip wheel --no-deps --wheel-dir /wheels .

# --- the runtime ------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
# torch comes first and from its own index: resolved through Forgeline's requirements, pip could
# pick a build for the wrong device. CPU: .../whl/cpu; CUDA: e.g. .../whl/cu128.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
# Empty for an agent; control, data, plots or all for the other roles (comma-separated works).
ARG FORGELINE_EXTRA=
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    FORGELINE_HOME=/var/lib/forgeline
# bubblewrap: the agent runs each job's ranks in a box of their own (trainer/rank_box.py); the
# pod needs unprivileged user namespaces (README, Users' code runs in a box). gcc and the C
# library's headers: Triton compiles a small C launcher with the system's compiler at a run's
# first torch.compile on a GPU, and fails without one.
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels/ /tmp/wheels/
RUN pip install "$(echo /tmp/wheels/forgeline-*.whl)${FORGELINE_EXTRA:+[${FORGELINE_EXTRA}]}" \
    && rm -rf /tmp/wheels
# A numeric non-root user, so Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/forgeline --no-create-home \
        forgeline \
    && install -d -o 10001 -g 10001 /var/lib/forgeline
USER 10001:10001
# The state folder (node cache, metric spool, logs): node-local disk, mounted over this volume.
VOLUME ["/var/lib/forgeline"]
WORKDIR /var/lib/forgeline
ENTRYPOINT ["forgeline"]
CMD ["--help"]
