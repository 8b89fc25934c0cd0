# Set up a GPU machine of the project's device image for `kvpilot bench` and `make test-gpu`.
# Source it from the repository root at the start of a device call:
#
#   source benchmarks/device_setup.sh && make bench-gpu BENCH_OUT=$OUT/bench.json
#
# The image has torch 2.11, triton 3.6, transformers 5.17, httpx, prometheus-client, jinja2 and
# safetensors, but not fastapi, starlette, uvicorn or pydantic (the server, hence the `http` figure).
# Those come as wheels in .whl/ (an ignored folder carried with the working tree), installed into
# /tmp/site without touching the image's packages; then kvpilot itself is installed in editable mode
# without dependencies, from / so that the repository's `operator/` folder cannot shadow the standard
# library's `operator` during the install. It ends by printing the versions and the GPUs it sees.
# Sourced, not run: it exports PYTHONPATH and PATH into the calling shell. Nothing here exits that shell.

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    echo "device_setup.sh must be sourced: source benchmarks/device_setup.sh" >&2
    exit 1
fi

kvpilot_device_setup() {
    local repo py_bin
    repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    if compgen -G "$repo/.whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site "$repo"/.whl/*.whl || { echo "device_setup: installing .whl/ failed" >&2; return 1; }
        case ":${PYTHONPATH:-}:" in
            *:/tmp/site:*) ;;
            *) export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" ;;
        esac
    else
        echo "device_setup: no wheels in $repo/.whl (the http figure and the server need fastapi, uvicorn, pydantic)" >&2
    fi
    (cd / && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e "$repo") \
        || { echo "device_setup: pip install -e $repo failed" >&2; return 1; }
    # `kvpilot` lands beside the image's python3, which need not be on PATH.
    py_bin="$(python3 -c 'import os, sys; print(os.path.dirname(sys.executable))')"
    case ":$PATH:" in
        *":$py_bin:"*) ;;
        *) export PATH="$py_bin:$PATH" ;;
    esac
    if [[ -d "$repo/../shared/models/stories260K" && -z "${KVPILOT_STORIES260K_DIR:-}" ]]; then
        export KVPILOT_STORIES260K_DIR="$repo/../shared/models/stories260K"
    fi
    (cd / && python3 - <<'PY'
import importlib

import torch

mods = ["triton", "transformers", "safetensors", "httpx", "fastapi", "uvicorn", "pydantic", "kvpilot"]
versions = []
for name in mods:
    try:
        versions.append(f"{name} {getattr(importlib.import_module(name), '__version__', '?')}")
    except Exception as exc:  # a missing server package costs only the http figure
        versions.append(f"{name} MISSING ({type(exc).__name__})")
gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"device_setup: torch {torch.__version__}; " + "; ".join(versions))
print(f"device_setup: {len(gpus)} GPU(s): {', '.join(gpus) or 'none'}")
PY
    )
    command -v kvpilot >/dev/null || { echo "device_setup: kvpilot is not on PATH" >&2; return 1; }
}

kvpilot_device_setup
