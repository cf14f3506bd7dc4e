# Image for the Helm chart (helm/mtpserve) and for `serve deploy` on any Ray cluster.
#   docker build -t mtpserve:0.1.0 .
# The base must carry the same Ray as pyproject.toml pins (2.60) and CUDA for the GPU engines;
# `-gpu` aliases the release's default CUDA build (pin e.g. RAY_IMAGE=...-py311-cu124 instead).
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311-gpu
FROM ${RAY_IMAGE}

WORKDIR /home/ray/mtpserve

# Dependencies first, so code edits do not re-download torch: install the pinned deps from
# pyproject.toml alone, then the project itself without touching them again.
COPY --chown=ray:users pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY --chown=ray:users . .
RUN pip install --no-cache-dir --no-deps . \
    && python -c "import cluster.config, ray; assert ray.__version__.startswith('2.60'), ray.__version__"

# The embedded default checkpoint stays in the source tree (models/ is not a Python package);
# point the default model path at it so it is found from the installed packages too.
ENV MTPSERVE_MODEL=/home/ray/mtpserve/models/tiny-code-mtp \
    PYTHONUNBUFFERED=1

EXPOSE 8000 8265 6379 8080
# KubeRay replaces the command with `ray start ...`. Alone, the image serves configs/gpu-node.yaml
# (3 GPUs): `docker run --gpus all --shm-size 8g -p 8000:8000 mtpserve:0.1.0`.
CMD ["serve", "run", "configs/gpu-node.yaml"]
