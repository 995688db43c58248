# dpdro image: ONE image for every process of a deployment, with the entry point chosen per service in compose.yaml:
#   flower-superexec (default)   ServerApp executor (SuperLink side) and ClientApp executors (one per SuperNode)
#   flower-superlink             the SuperLink            flower-supernode   a SuperNode
#   python -m dpdro.launch.fleet_gateway                  the Fleet-only gateway (the one port open to sites)
# Why one image: every host of a deployment runs an executor (the operator's the ServerApp, each site its ClientApps),
# and both apps need torch, which is almost all of the image; flwr (SuperLink, SuperNode) is a small layer of the
# same image, so a second, torch-free image would save no disk on any host and add a build to keep in step.
#
# Built and run for real with podman 4.3.1 (tests/test_containers.py, docs/OPERATOR.md "Containers"):
#   podman build -t dpdro:0.1.0 .                                     # on Flower's official image (a registry)
#   podman build -t dpdro:0.1.0 --build-arg BASE_IMAGE=localhost/dpdro-debian-base:bookworm .  # a base you made
# Build arguments:
#   BASE_IMAGE       default flwr/superexec:1.42.0 (Flower's image: Python, flwr and user "app"); any Debian-like
#                    image works: without Python, python3 and a venv are installed from its apt sources.
#   WHEELS           folder INSIDE the build context holding torch's wheels (containers/wheels by default, filled by
#                    `pip download`, see docs/OPERATOR.md); when it holds a torch wheel, torch and its dependencies
#                    are installed from it only (--no-index), as the project installs them; empty: from the index.
#   TORCH_INDEX_URL  index for torch when WHEELS holds none (e.g. https://download.pytorch.org/whl/cpu or .../cu128);
#                    empty: PyPI.
#   EXTRA_CA_CERTS   PEM text of extra CA certificates to trust (e.g. a proxy that re-signs HTTPS during the build):
#                    --build-arg EXTRA_CA_CERTS="$(cat proxy-ca.crt)". Added to the image's system trust store.
#   PIP_NO_INDEX     set to 1 for a build without internet: everything (dpdro's dependencies too) from WHEELS.
ARG BASE_IMAGE=flwr/superexec:1.42.0
FROM ${BASE_IMAGE}

ARG WHEELS=containers/wheels
ARG TORCH_INDEX_URL=
ARG EXTRA_CA_CERTS=
ARG PIP_NO_INDEX

USER root
# Apps run in this image's environment: never `uv sync` a fresh runtime env per run (would download torch).
ENV PATH=/python/venv/bin:$PATH \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    DPDRO_CACHE_DIR=/cache \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A base without Python (e.g. a debootstrap'ed Debian): Python 3 and a venv at Flower's path; the user "app" that
# Flower's images run as (uid 49999), so volumes and file modes are the same on either base.
RUN set -eu; \
    if ! command -v python >/dev/null 2>&1; then \
        apt-get update; \
        apt-get install -y --no-install-recommends python3 python3-venv ca-certificates; \
        rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin; \
        python3 -m venv /python/venv; \
    fi; \
    id app >/dev/null 2>&1 || useradd --uid 49999 --user-group --home-dir /app --no-create-home app; \
    mkdir -p /app /app/state /app/runs /cache /data; \
    chown app:app /app /app/state /app/runs /cache

RUN set -eu; \
    if [ -n "${EXTRA_CA_CERTS}" ]; then \
        mkdir -p /usr/local/share/ca-certificates; \
        printf '%s\n' "${EXTRA_CA_CERTS}" > /usr/local/share/ca-certificates/dpdro-build-extra.crt; \
        update-ca-certificates; \
    fi

# torch first (the versions pyproject.toml's [tool.dpdro.tested] records): from the wheel folder when it holds
# torch, else from the index.
# pip trusts the system store (with the extra CAs) rather than its own bundled one.
RUN --mount=type=bind,source=${WHEELS},target=/wheels \
    set -eu; \
    if ls /wheels/torch-*.whl >/dev/null 2>&1; then src="--no-index --find-links /wheels"; \
    elif [ -n "${TORCH_INDEX_URL}" ]; then src="--index-url ${TORCH_INDEX_URL}"; \
    else src=""; fi; \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt python -m pip install --no-cache-dir $src \
        torch==2.14.1 torchvision==0.29.1

WORKDIR /app
COPY --chown=app:app pyproject.toml README.md ./
COPY --chown=app:app dpdro ./dpdro
COPY --chown=app:app common ./common
COPY --chown=app:app server ./server
COPY --chown=app:app client ./client
# launch: the fleet-gateway service; simulations: pyproject.toml lists it as a package, so `pip install .` needs it
COPY --chown=app:app launch ./launch
COPY --chown=app:app simulations ./simulations
# Drop the [simulation] extra (Ray), which only the simulation engine needs; flwr stays at the base image's 1.42.0
# (within pyproject.toml's range, so pip keeps it).
# Editable, as in the tested loopback deployment: Flower puts the unpacked app (FAB: dpdro/ holds only __init__.py, api.py
# and cli/, the sub-packages are mapped from common/, server/, ...) first on sys.path, and the editable finder is what
# resolves dpdro.server & co. behind it; a plain install would be shadowed by the FAB's partial dpdro/.
# The [features] extra (kymatio) so that features=scatternet runs on every node: a node computes its own records'
# scattering features (common/scattering.py).
RUN --mount=type=bind,source=${WHEELS},target=/wheels \
    set -eu; \
    sed -i 's/"flwr\[simulation\]/"flwr/' pyproject.toml; \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt python -m pip install --no-cache-dir --find-links /wheels -e ".[features]"; \
    rm -rf build; chown -R app:app /app/*.egg-info

USER app
ENTRYPOINT ["flower-superexec"]
