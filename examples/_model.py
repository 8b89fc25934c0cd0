"""Where the examples find a model: $KVPILOT_MODEL, else stories260K converted into the cache.

The seed's examples name Hub models (TinyLlama, Llama-3.1-8B); here they run as written against the
real, tiny stories260K model, so that they need no network and no GPU.
"""

import os


def model_path() -> str:
    if os.environ.get("KVPILOT_MODEL"):
        return os.environ["KVPILOT_MODEL"]
    from kvpilot.tools.convert_llama2c import ensure_stories260k

    return str(ensure_stories260k())


MODEL = model_path()
