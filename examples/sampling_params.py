"""The API documentation's full SamplingParams example."""

from _model import MODEL
from kvpilot import LLM, SamplingParams

sampling_params = SamplingParams(
    # Decoding strategy
    temperature=0.8,           # Randomness (0.0 = deterministic)
    top_k=50,                  # Top-K sampling
    top_p=0.95,                # Nucleus sampling

    # Length control
    max_tokens=512,            # Max generated tokens
    min_tokens=10,             # Min generated tokens

    # Multiple outputs
    n=1,                       # Number of completions per prompt
    best_of=1,                 # Generate N, return best

    # Beam search
    use_beam_search=False,

    # Logprobs
    logprobs=5,                # Return top-5 logprobs per token
    prompt_logprobs=True,      # Return logprobs for prompt tokens

    # Stop conditions
    stop=["\n\n", "END"],      # Custom stop strings

    # Advanced
    frequency_penalty=0.0,     # Penalize repeated tokens
    presence_penalty=0.0,      # Penalize already-seen tokens
    repetition_penalty=1.0,    # Repetition penalty
)

with LLM(model=MODEL) as llm:
    out = llm.generate("Once upon a time", sampling_params)
    choice = out.outputs[0]
    print(repr(choice.text))
    print("finish_reason:", choice.finish_reason, "stop_reason:", choice.stop_reason)
    print("first token's top logprobs:", {llm.tokenizer.decode([t]): round(lp.logprob, 3)
                                          for t, lp in choice.logprobs[0].items()})
    print("prompt logprobs:", out.prompt_logprobs[:3])
