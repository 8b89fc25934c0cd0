# The kvpilot operator: `kvpilot operator` (kopf). Build from the repository root:
#   docker build -f images/operator.Dockerfile -t ghcr.io/kvpilot/kvpilot-operator:0.1.0 .
ARG PYTHON_IMAGE=python:3.12-slim
FROM ${PYTHON_IMAGE}

# The operator never runs a model, but `import kvpilot.operator` imports the `kvpilot` package,
# whose dependencies include torch: take the small CPU build.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVPILOT_CRD=/opt/kvpilot/crds/serving.kvpilot.io_llmdeployments.yaml

RUN pip install --index-url ${TORCH_INDEX} torch
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine engine
COPY kernels kernels
COPY operator operator
RUN pip install . && rm -rf /src
# render() applies the CRD's defaults and rules, so the operator carries the CRD file.
COPY crds /opt/kvpilot/crds

RUN useradd --uid 1000 --user-group --no-create-home kvpilot
USER 1000:1000
WORKDIR /tmp
EXPOSE 8080
ENTRYPOINT ["kvpilot"]
CMD ["operator"]
