"""The API documentation's Context Manager example."""

from _model import MODEL
from kvpilot import LLM, SamplingParams

# Automatic cleanup with context manager
with LLM(model=MODEL) as llm:
    outputs = llm.generate(["Hello world"], SamplingParams())
    for output in outputs:
        print(output.outputs[0].text)

# LLM is automatically shut down here
