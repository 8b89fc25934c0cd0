"""The API documentation's Quick Start: synchronous batch generation."""

from _model import MODEL
from kvpilot import LLM, SamplingParams

# Initialize LLM
llm = LLM(model=MODEL)

# Define prompts
prompts = [
    "Hello, my name is",
    "The capital of France is",
    "The future of AI is",
]

# Configure sampling
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64)

# Generate (synchronous)
for output in llm.generate(prompts, sampling_params):
    print(f"Prompt: {output.prompt!r}")
    print(f"Generated: {output.outputs[0].text!r}\n")

llm.shutdown()
