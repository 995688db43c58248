# dpdro image: runs our ServerApp and ClientApps (CPU torch). The deployment issue extends this to
# Flower's SuperExec base image, TLS and a compose file.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY dpdro ./dpdro
COPY common ./common
COPY server ./server
COPY client ./client
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu . 
ENTRYPOINT ["dpdro"]
