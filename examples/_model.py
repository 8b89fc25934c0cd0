"""Where the examples find a model: $KVPILOT_MODEL, else stories260K converted into the cache.

The API documentation's examples name Hub models (TinyLlama, Llama-3.1-8B); here they run as written against the
real, tiny stories260K model, so that they need no network and no GPU.
"""

from kvpilot import envs


def model_path() -> str:
    if envs.examples_model() is not None:
        return str(envs.examples_model())
    from kvpilot.tools.convert_llama2c import ensure_stories260k

    return str(ensure_stories260k())


MODEL = model_path()
