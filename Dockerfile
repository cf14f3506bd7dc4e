# Image for the Helm chart (helm/mtpserve) and for `serve deploy` on any Ray cluster.
#
#   GPU: docker build -t mtpserve:0.1.0 .
#   CPU: docker build --build-arg VARIANT=cpu -t mtpserve:0.1.0-cpu .   (ci/cpu-values.yaml)
#
# The base carries the Ray that pyproject.toml pins (2.60) and, for the GPU variant, the CUDA 12.8
# user-space libraries. torch comes from PyTorch's own index for that same CUDA build (not PyPI's
# default, whose CUDA may differ from the base), pinned to TORCH_VERSION; the build fails unless
# `torch.version.cuda` is that CUDA. Minimum NVIDIA driver on the nodes: 570.26 (CUDA 12.8); see
# helm/mtpserve/README.md. To move CUDA, change RAY_IMAGE_GPU and TORCH_CUDA together (e.g.
# `rayproject/ray:2.60.0-py311-cu124` with `cu124`, driver >= 550.54).
ARG VARIANT=gpu
ARG RAY_IMAGE_GPU=rayproject/ray:2.60.0-py311-cu128
ARG RAY_IMAGE_CPU=rayproject/ray:2.60.0-py311

FROM ${RAY_IMAGE_GPU} AS base-gpu
ARG TORCH_CUDA=cu128
ENV MTPSERVE_TORCH_INDEX=${TORCH_CUDA}

FROM ${RAY_IMAGE_CPU} AS base-cpu
ENV MTPSERVE_TORCH_INDEX=cpu

FROM base-${VARIANT}
ARG TORCH_VERSION=2.13.0

# tcmalloc: CPU replicas preload it (workers/allocator.py; ~20% faster CPU decode steps).
# Ubuntu 24.04 renamed the package (t64).
USER root
RUN apt-get update \
    && (apt-get install -y --no-install-recommends libtcmalloc-minimal4 \
        || apt-get install -y --no-install-recommends libtcmalloc-minimal4t64) \
    && rm -rf /var/lib/apt/lists/*
USER 1000

WORKDIR /home/ray/mtpserve

# torch first, from the index of the CUDA build (or the CPU build), then a constraint keeps the
# other dependencies from replacing it with PyPI's build. CUDA_VERSION is set by the nvidia/cuda
# images Ray's GPU images build on: the base's CUDA must be torch's too.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" \
        --index-url "https://download.pytorch.org/whl/${MTPSERVE_TORCH_INDEX}" \
    && echo "torch==${TORCH_VERSION}" > /tmp/constraints.txt \
    && python -c "\
import os, torch; \
index = os.environ['MTPSERVE_TORCH_INDEX']; \
want = None if index == 'cpu' else index[2:-1] + '.' + index[-1]; \
base = os.environ.get('CUDA_VERSION'); \
assert torch.version.cuda == want, f'torch {torch.__version__} has CUDA {torch.version.cuda}, want {want}'; \
assert not (want and base) or base.startswith(want + '.'), f'base image CUDA {base}, torch {want}'; \
print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'base CUDA', base)"

# Dependencies next, so code edits do not re-download them: the pinned deps from pyproject.toml
# alone, then the project itself without touching them again.
COPY --chown=ray:users pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt -c /tmp/constraints.txt \
    && rm /tmp/requirements.txt

# The project as a wheel (one import name, `mtpserve`; the embedded model and the Serve configs
# are package data), built in the image and installed; the source tree is then removed, so the
# image runs exactly what `pip install mtpserve-*.whl` gives anywhere.
COPY --chown=ray:users . /tmp/src
RUN pip wheel --no-cache-dir --no-deps -w /tmp/wheels /tmp/src \
    && pip install --no-cache-dir --no-deps /tmp/wheels/mtpserve-*.whl \
    && rm -rf /tmp/src /tmp/wheels \
    && mkdir -p configs \
    && cp "$(python -c 'from mtpserve.workers.paths import config_path; print(config_path(""))')"/*.yaml configs/ \
    && python -c "import mtpserve.cluster.config, ray, torch, huggingface_hub; assert ray.__version__.startswith('2.60'), ray.__version__; assert torch.__version__.split('+')[0] == '${TORCH_VERSION}', torch.__version__"

ENV PYTHONUNBUFFERED=1

# The chart runs pods as uid 1000 (the image's `ray` user), non-root.
USER 1000
EXPOSE 8000 8265 6379 8080
# KubeRay replaces the command with `ray start ...`. Alone, the GPU image serves
# configs/gpu-node.yaml (3 GPUs): `docker run --gpus all --shm-size 8g -p 8000:8000 mtpserve:0.1.0`;
# the CPU image configs/local-cpu.yaml: `docker run --shm-size 2g -p 8000:8000 mtpserve:0.1.0-cpu
# serve run configs/local-cpu.yaml`.
CMD ["serve", "run", "configs/gpu-node.yaml"]
