"""The API documentation's Chat Application example (reads lines from stdin; 'quit' ends it).

stories260K ships without a chat template, so one is set on the tokenizer first (a model with its
own template in tokenizer_config.json needs no such line).
"""

import asyncio
from typing import Dict, List

from _model import MODEL
from kvpilot import LLM, SamplingParams

STORY_TEMPLATE = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"


class ChatBot:
    def __init__(self, model_name: str):
        self.llm = LLM(model=model_name)
        if self.llm.tokenizer.chat_template is None:
            self.llm.tokenizer.chat_template = STORY_TEMPLATE
        self.conversation_history: List[Dict[str, str]] = []

    def format_prompt(self, message: str) -> str:
        """Format conversation history + new message."""
        self.conversation_history.append({"role": "user", "content": message})

        # Use tokenizer's chat template
        prompt = self.llm.tokenizer.apply_chat_template(
            self.conversation_history,
            tokenize=False,
            add_generation_prompt=True,
        )
        return prompt

    async def chat(self, message: str) -> str:
        """Send a message and get response."""
        prompt = self.format_prompt(message)

        sampling_params = SamplingParams(
            temperature=0.7,
            top_p=0.9,
            max_tokens=64,
        )

        output = await self.llm.generate_async(prompt, sampling_params)
        response = output.outputs[0].text

        # Add assistant response to history
        self.conversation_history.append({"role": "assistant", "content": response})

        return response


async def main():
    chatbot = ChatBot(MODEL)

    print("Chatbot ready! Type 'quit' to exit.\n")

    while True:
        try:
            user_input = input("You: ")
        except EOFError:
            break
        if user_input.lower() == "quit":
            break

        response = await chatbot.chat(user_input)
        print(f"Bot: {response}\n")
    chatbot.llm.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
