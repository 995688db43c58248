# dpdro executor image: runs our ServerApp (on the SuperLink side) and our ClientApps (one executor per SuperNode)
# under Flower's SuperExec. Base: Flower's own superexec image, so the executor, the flwr-serverapp/flwr-clientapp
# processes and the Flower version (1.42.0) are Flower's; this image adds torch and the dpdro package.
#
#   docker build -t dpdro-superexec:0.1.0 .                                   # CPU torch (default)
#   docker build -t dpdro-superexec:0.1.0-cu128 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .  # CUDA torch
#
# Entry point: flower-superexec (from the base image); compose.yaml passes --runtime-api-address and TLS flags.
# NOT built here (no Docker engine on the development machine); tests/test_deployment.py checks it statically.
FROM flwr/superexec:1.42.0

# Where torch wheels come from: CPU by default; a CUDA index (e.g. .../whl/cu128) for GPU nodes.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

WORKDIR /app
# Apps run in this image's environment: never `uv sync` a fresh runtime env per run (would download torch).
ENV FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    DPDRO_CACHE_DIR=/cache \
    PYTHONUNBUFFERED=1

# torch first (pinned as in pyproject.toml), from the selected index.
RUN python -m pip install --no-cache-dir --index-url ${TORCH_INDEX_URL} \
        torch==2.14.1 torchvision==0.29.1

COPY --chown=app:app pyproject.toml README.md ./
COPY --chown=app:app dpdro ./dpdro
COPY --chown=app:app common ./common
COPY --chown=app:app server ./server
COPY --chown=app:app client ./client
# not imported by the apps, but pyproject.toml lists them as packages, so `pip install .` needs the folders
COPY --chown=app:app launch ./launch
COPY --chown=app:app simulations ./simulations
# flwr is already in the base image at 1.42.0; drop the [simulation] extra (Ray) that only simulation needs.
RUN sed -i 's/"flwr\[simulation\]==1.42.0"/"flwr==1.42.0"/' pyproject.toml \
    && python -m pip install --no-cache-dir --extra-index-url ${TORCH_INDEX_URL} .

ENTRYPOINT ["flower-superexec"]
