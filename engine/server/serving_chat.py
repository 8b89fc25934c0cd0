"""``POST /v1/chat/completions``: messages -> chat template -> one engine request with ``n`` choices.

Streaming follows OpenAI's chunk sequence per choice: a first chunk whose delta is
``{"role": "assistant", "content": ""}``, content chunks, then a chunk with an empty delta and the
``finish_reason`` (null on every earlier chunk); with ``stream_options.include_usage`` every chunk has
``"usage": null`` and a last chunk with no choices carries the usage; then ``data: [DONE]``. With
``echo`` (vLLM) and a final assistant message, each choice's content starts with that message's
text: prefixed to the message, or sent as each choice's first content chunk when streaming.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvpilot.outputs import Logprob, RequestError, RequestOutput
from kvpilot.server.chat_template import render_chat
from kvpilot.server.errors import APIError
from kvpilot.server.protocol import (ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
                       ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChatLogprob, ChatLogprobEntry,
                       ChatResponseMessage, DeltaMessage, UsageInfo, random_id)
from kvpilot.server.sampling import generation_defaults, chat_max_tokens, chat_params, check_context
from kvpilot.server.serving_completion import check_model, params_n, submit
from kvpilot.server.state import ServerState
from kvpilot.server.streaming import (SSE_DONE, EngineStreamingResponse, sse, stream_deltas, token_bytes, token_text,
                        until_disconnect, wait_all)

logger = logging.getLogger(__name__)


def chat_logprobs(tokenizer: Any, token_ids: list[int], entries: list[dict[int, Logprob]],
                  top_n: int) -> ChatChoiceLogprobs:
    """OpenAI's chat ``logprobs.content``: per token its text, logprob, bytes (the token's own: a
    byte-fallback token's byte, not U+FFFD's UTF-8) and the ``top_n`` most likely alternatives (by rank)."""
    content = []
    for tok, entry in zip(token_ids, entries):
        chosen = entry.get(tok)
        text = token_text(tokenizer, tok, chosen)
        top = sorted((v.rank or 0, t, v) for t, v in entry.items() if v.rank is not None and v.rank <= top_n)
        content.append(ChatLogprobEntry(
            token=text, logprob=chosen.logprob if chosen is not None else float("-inf"),
            bytes=token_bytes(tokenizer, tok, text),
            top_logprobs=[ChatLogprob(token=(s := token_text(tokenizer, t, v)), logprob=v.logprob,
                                      bytes=token_bytes(tokenizer, t, s)) for _, t, v in top[:top_n]]))
    return ChatChoiceLogprobs(content=content)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request) -> Response:
    """Serve one chat request (streaming or not). Raises `APIError` for bad input."""
    llm = state.llm
    model = check_model(state, req.model)
    if req.stream and req.best_of is not None and req.best_of > params_n(req):
        raise APIError("best_of > n cannot be streamed", param="best_of")
    prompt_ids = render_chat(llm.tokenizer, req.messages, state.chat_template, req.add_generation_prompt,
                             req.chat_template_kwargs, tools=req.tools, documents=req.documents,
                             continue_final_message=req.continue_final_message)
    param = "max_tokens" if req.max_completion_tokens is None and req.max_tokens is not None \
        else "max_completion_tokens"
    try:
        max_tokens = check_context(len(prompt_ids), chat_max_tokens(req), llm.max_seq_len, param)
    except APIError as exc:
        if exc.param == "prompt":
            exc.param = "messages"
        raise
    params = chat_params(req, max_tokens, generation_defaults(llm))
    request_id = random_id("chatcmpl")
    outputs = submit(llm, [prompt_ids], params, streaming=bool(req.stream), prompt_param="messages",
                     max_tokens_param=param, lora_request=state.lora_request(model))
    if req.stream:
        return EngineStreamingResponse(_stream(state, req, model, request_id, outputs[0], len(prompt_ids)),
                                       state, outputs)
    state.begin()
    try:
        with state.tracking(outputs):
            out = (await until_disconnect(raw, wait_all(outputs)))[0]
    except RequestError as exc:
        raise APIError(f"generation failed: {exc}", status=500) from None
    finally:
        state.end()
    top_n = req.top_logprobs or 0
    echo = echo_text(req)
    choices = []
    for c in out.outputs:
        lp = chat_logprobs(llm.tokenizer, c.token_ids, c.logprobs, top_n) if req.logprobs else None
        choices.append(ChatCompletionChoice(index=c.index, message=ChatResponseMessage(content=echo + c.text),
                                            logprobs=lp, finish_reason=c.finish_reason,
                                            stop_reason=c.stop_reason))
    usage = UsageInfo.of(len(prompt_ids), sum(len(c.token_ids) for c in out.outputs))
    body = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
    return JSONResponse(body.model_dump())


def echo_text(req: ChatCompletionRequest) -> str:
    """What ``echo`` puts before each choice's content: the last message's text when it is the
    assistant's (the role of the reply), else "" (vLLM's rule)."""
    last = req.messages[-1]
    return last.text() if req.echo and last.role == "assistant" else ""


async def _stream(state: ServerState, req: ChatCompletionRequest, model: str, request_id: str,
                  out: RequestOutput, num_prompt_tokens: int) -> AsyncIterator[str]:
    tokenizer = state.llm.tokenizer
    include_usage = req.include_usage
    top_n = req.top_logprobs or 0
    completion_tokens = 0
    created = int(time.time())  # one id and one creation time for every chunk of the stream (OpenAI)

    def chunk(choice: ChatCompletionStreamChoice) -> str:
        body = ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice])
        return sse(body.model_dump_json(exclude=None if include_usage else {"usage"}))

    try:
        echo = echo_text(req)
        for i in range(params_n(req)):
            yield chunk(ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
            if echo:
                yield chunk(ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=echo)))
        async for deltas in stream_deltas([out]):
            for d in deltas:
                completion_tokens += len(d.token_ids)
                if d.text or d.token_ids:
                    lp = chat_logprobs(tokenizer, d.token_ids, d.logprobs, top_n) if req.logprobs else None
                    yield chunk(ChatCompletionStreamChoice(index=d.index, delta=DeltaMessage(content=d.text),
                                                           logprobs=lp))
                if d.finish_reason is not None:
                    yield chunk(ChatCompletionStreamChoice(index=d.index, delta=DeltaMessage(),
                                                           finish_reason=d.finish_reason,
                                                           stop_reason=d.stop_reason))
        if include_usage:
            usage = UsageInfo.of(num_prompt_tokens, completion_tokens)
            yield sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                                   usage=usage).model_dump_json())
        yield SSE_DONE
    except RequestError as exc:
        logger.error("request %s failed: %s", request_id, exc)
        yield sse(json.dumps(APIError(f"generation failed: {exc}", status=500).body()))
        yield SSE_DONE
