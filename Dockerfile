# diffusiond, for NVIDIA GPUs (the default) or for the CPU: one Dockerfile, the bases and torch chosen by arguments.
#   docker build -t diffusiond .
#   docker run --gpus all -p 8000:8000 -e DIFFUSIOND_API_KEY=... -v diffusiond-cache:/var/cache/diffusiond \
#       diffusiond --model ID_OR_DIR --nproc 1
# The CPU image (docs/service.md; tests/service/test_image.py builds and runs it with buildah):
#   docker build -t diffusiond:cpu --build-arg BUILD_BASE=debian:bookworm-slim --build-arg RUNTIME_BASE=debian:bookworm-slim \
#       --build-arg TORCH="torch==2.13.0 torchvision==0.28.0 --index-url https://download.pytorch.org/whl/cpu" \
#       --build-arg EXTRAS=postgres,vision --build-arg DEVICE=cpu --build-arg DTYPE=float32 .
# Arguments after the image name go to `diffusiond serve`; settings also come from DIFFUSIOND_* variables (-e).
ARG BUILD_BASE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04
ARG RUNTIME_BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

# ---- deps: a virtual environment with torch and every dependency, in a layer that only pyproject.toml and the
# arguments change (so that a change of diffusiond's code rebuilds neither torch nor flash-attn)
FROM ${BUILD_BASE} AS deps
# The torch requirement(s) pip installs first, with any pip option they need (an --index-url, a wheel's path).
# torchvision's wheels require one exact torch: the pair's own release.
ARG TORCH="torch==2.14.1 torchvision==0.29.1"
# diffusiond's extras: gpu (flash-attn), postgres (--state-url), vision (torchvision: Qwen-Image-Edit, FLUX.2 [dev]),
# video, audio, quant.
ARG EXTRAS=gpu,postgres,vision
# GPU generations flash-attn is compiled for when no prebuilt wheel fits (80: A100, 90: H100/H200): each one more
# adds most of an hour to the build.
ARG FLASH_ATTN_CUDA_ARCHS="80;90"
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 MAX_JOBS=4 \
    FLASH_ATTN_CUDA_ARCHS=${FLASH_ATTN_CUDA_ARCHS}
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/diffusiond
ENV PATH=/opt/diffusiond/bin:$PATH
WORKDIR /src
COPY pyproject.toml ./
COPY deploy/requirements.py deploy/
# flash-attn compiles against the installed torch: torch and the build tools first, then no build isolation.
# PyPI's Linux x86_64 torch wheels are CUDA builds.
# hadolint ignore=DL3013,SC2086
RUN pip install ${TORCH} \
    && python3 deploy/requirements.py "${EXTRAS}" > /tmp/requirements.txt \
    && case ",${EXTRAS}," in \
        *,gpu,*) pip install "setuptools>=69" "wheel>=0.43" "packaging>=24" "ninja>=1.11" "psutil>=5.9" \
            && pip install --no-build-isolation -r /tmp/requirements.txt ;; \
        *) pip install -r /tmp/requirements.txt ;; \
    esac

# ---- wheel: diffusiond itself (the bundled model, the playground, the dashboard)
FROM deps AS wheel
COPY . .
RUN pip wheel --no-deps -w /dist .

# ---- runtime: the runtime base, the virtual environment, a user without privileges
FROM ${RUNTIME_BASE} AS runtime-deps
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 curl ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 diffusiond \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /var/lib/diffusiond diffusiond \
    && install -d -o diffusiond -g diffusiond /var/cache/diffusiond
COPY --from=deps /opt/diffusiond /opt/diffusiond

FROM runtime-deps
# Where the daemon runs (cpu for the CPU image) and its weights' dtype there.
ARG DEVICE=cuda
ARG DTYPE=bfloat16
COPY --from=wheel /dist /tmp/dist
# hadolint ignore=DL3013
RUN /opt/diffusiond/bin/pip install --no-cache-dir --no-deps /tmp/dist/*.whl && rm -rf /tmp/dist
# Settings as variables, not CMD arguments, so that arguments given to `docker run` (which replace CMD) keep them.
# Inside a container the daemon must listen on every interface (its own default is loopback only). Beyond loopback
# it refuses to start without an API key: pass -e DIFFUSIOND_API_KEY=... (or --env-file), or
# -e DIFFUSIOND_ALLOW_UNAUTHENTICATED=true when something in front of it authenticates.
ENV PATH=/opt/diffusiond/bin:$PATH \
    HOME=/var/lib/diffusiond \
    XDG_CACHE_HOME=/var/cache/diffusiond \
    HF_HOME=/var/cache/diffusiond/huggingface \
    DIFFUSIOND_CACHE=/var/cache/diffusiond/models \
    DIFFUSIOND_HOST=0.0.0.0 \
    DIFFUSIOND_PORT=8000 \
    DIFFUSIOND_DEVICE=${DEVICE} \
    DIFFUSIOND_DTYPE=${DTYPE} \
    DIFFUSIOND_LOG_FORMAT=json
# Downloaded checkpoints and the bundled default model, kept across containers.
VOLUME ["/var/cache/diffusiond"]
USER 10001:10001
WORKDIR /var/lib/diffusiond
EXPOSE 8000
# Liveness: /health turns 503 when the engine failed (/ready is the load balancers' readiness check).
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["sh", "-c", "curl -fsS -o /dev/null http://127.0.0.1:${DIFFUSIOND_PORT}/health"]
# `docker stop` sends SIGTERM and waits 10 s by default: requests in flight get drain_timeout (30 s) to finish,
# so stop with `docker stop --time 40`, or set DIFFUSIOND_DRAIN_TIMEOUT below the wait.
ENTRYPOINT ["diffusiond", "serve"]
# Default arguments, e.g. `docker run ... diffusiond --model ID --nproc 2` (one rank per GPU; DIFFUSIOND_NPROC works
# too). None by default, so that no argument overrides a DIFFUSIOND_* variable.
CMD []
