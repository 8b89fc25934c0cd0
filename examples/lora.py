"""The API documentation's LoRA Adapters example, run as written from the directory that holds
``./lora-adapter-1`` and ``./lora-adapter-2``.

Those are PEFT adapter directories; where they do not exist yet, two random ones for the example's
model are made first with peft (a demonstration: random adapters only change which tokens the
model prefers).
"""

import os

from _model import MODEL
from kvpilot import LLM, SamplingParams
from kvpilot.executor import LoRARequest
from kvpilot.llmapi import LoraConfig


def make_random_adapter(path: str, seed: int) -> None:
    import torch
    from peft import LoraConfig as PeftLoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    peft_model = get_peft_model(model, PeftLoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                                      target_modules=["q_proj", "v_proj", "down_proj"]))
    peft_model.save_pretrained(path)


for i, path in enumerate(["./lora-adapter-1", "./lora-adapter-2"]):
    if not os.path.isdir(path):
        make_random_adapter(path, seed=i)

# Initialize with LoRA config
llm = LLM(
    model=MODEL,
    lora_config=LoraConfig(
        lora_dir=["./lora-adapter-1", "./lora-adapter-2"],
        max_loras=4
    )
)

# Use LoRA adapter for specific request
lora_request = LoRARequest(lora_name="adapter1", lora_int_id=1, lora_path="./lora-adapter-1")

output = llm.generate(
    "Write a poem about",
    sampling_params=SamplingParams(max_tokens=128),
    lora_request=lora_request
)
print(f"adapter1: {output.outputs[0].text!r}")

# One batch, one adapter (or none) per prompt
adapter2 = LoRARequest(lora_name="adapter2", lora_int_id=2, lora_path="./lora-adapter-2")
greedy = SamplingParams(max_tokens=24, temperature=0.0)
for name, out in zip(["adapter1", "adapter2", "base"],
                     llm.generate(["Once upon a time"] * 3, greedy, lora_request=[lora_request, adapter2, None])):
    print(f"{name}: {out.outputs[0].text!r}")

llm.shutdown()
