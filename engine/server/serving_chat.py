"""``POST /v1/chat/completions``: messages -> chat template -> one engine request with ``n`` choices.

Streaming follows OpenAI's chunk sequence per choice: a first chunk whose delta is
``{"role": "assistant", "content": ""}``, content chunks, then a chunk with an empty delta and the
``finish_reason`` (null on every earlier chunk); with ``stream_options.include_usage`` every chunk has
``"usage": null`` and a last chunk with no choices carries the usage; then ``data: [DONE]``. With
``echo`` (vLLM) and a final assistant message, each choice's content starts with that message's
text: prefixed to the message, or sent as each choice's first content chunk when streaming.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvpilot.outputs import Logprob, RequestError, RequestOutput
from kvpilot.server.chat_template import render_chat
from kvpilot.server.errors import APIError
from kvpilot.server.protocol import (ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
                       ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChatLogprob, ChatLogprobEntry,
                       ChatResponseMessage, DeltaMessage, FunctionCall, ToolCall, UsageInfo, random_id)
from kvpilot.server.sampling import (chat_max_tokens, chat_params, check_context, compile_guided, generation_defaults,
                                    guided_params)
from kvpilot.server.serving_completion import check_model, params_n, submit
from kvpilot.server.reasoning import ReasoningStream, split_reasoning
from kvpilot.server.state import ServerState
from kvpilot.server.tool_parsers import (ToolStream, extract_tool_calls, get_parser, named_parser, named_schema,
                                         parse_json_array, required_schema)
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
    reply = ReplyPlan.of(state, req)
    params = reply.adjust(params, req)
    await compile_guided(llm, params, reply.guided_param or guided_params(req)[1])
    request_id = random_id("chatcmpl")
    outputs = submit(llm, [prompt_ids], params, streaming=bool(req.stream), prompt_param="messages",
                     max_tokens_param=param, lora_request=state.lora_request(model))
    if req.stream:
        return EngineStreamingResponse(_stream(state, req, model, request_id, outputs[0], len(prompt_ids), reply),
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
        message, finish_reason = reply.message(echo + c.text if not reply.parses else c.text, c.finish_reason)
        if reply.parses and echo:
            message.content = echo + (message.content or "")
        choices.append(ChatCompletionChoice(index=c.index, message=message, logprobs=lp,
                                            finish_reason=finish_reason, stop_reason=c.stop_reason))
    usage = UsageInfo.of(len(prompt_ids), sum(len(c.token_ids) for c in out.outputs))
    body = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
    return JSONResponse(body.model_dump())


def echo_text(req: ChatCompletionRequest) -> str:
    """What ``echo`` puts before each choice's content: the last message's text when it is the
    assistant's (the role of the reply), else "" (vLLM's rule)."""
    last = req.messages[-1]
    return last.text() if req.echo and last.role == "assistant" else ""


async def _stream(state: ServerState, req: ChatCompletionRequest, model: str, request_id: str,
                  out: RequestOutput, num_prompt_tokens: int, reply: "ReplyPlan") -> AsyncIterator[str]:
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
        splitters: dict[int, ReplyStream] = {}
        async for deltas in stream_deltas([out]):
            for d in deltas:
                completion_tokens += len(d.token_ids)
                split = splitters.get(d.index)
                if split is None:
                    split = splitters[d.index] = reply.stream()
                if d.text or d.token_ids:
                    lp = chat_logprobs(tokenizer, d.token_ids, d.logprobs, top_n) if req.logprobs else None
                    delta = split.feed(d.text)
                    if delta is not None or lp is not None:
                        yield chunk(ChatCompletionStreamChoice(index=d.index, delta=delta or DeltaMessage(),
                                                               logprobs=lp))
                if d.finish_reason is not None:
                    delta = split.finish()
                    if delta is not None:
                        yield chunk(ChatCompletionStreamChoice(index=d.index, delta=delta))
                    yield chunk(ChatCompletionStreamChoice(index=d.index, delta=DeltaMessage(),
                                                           finish_reason=split.finish_reason(d.finish_reason),
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


# ---- tool calls and reasoning ---------------------------------------------------------------------


@dataclass
class ReplyPlan:
    """How a chat reply is read: a tool-call parser (``tool_choice`` "auto" with
    ``--tool-call-parser``, or a forced call's own parser), the reasoning parser, and the grammar a
    forced call is decoded under (``tool_choice`` "required": a JSON list of calls; a named
    function: its parameters' JSON schema).

    ``guided_param`` names the request field a grammar error is reported under."""

    tool_parser: Optional[Callable] = None
    max_calls: Optional[int] = None
    reasoning: Optional[str] = None
    guided: Optional[Any] = None
    guided_param: Optional[str] = None
    skip_special_tokens: Optional[bool] = None

    @classmethod
    def of(cls, state: ServerState, req: ChatCompletionRequest) -> "ReplyPlan":
        """Raises APIError (400): a forced tool_choice without tools or naming an unknown function,
        or together with another structured-output constraint."""
        from kvpilot.sampling_params import GuidedDecodingParams

        plan = cls(reasoning=state.reasoning_parser)
        forced = req.forced_tool()
        parallel = req.parallel_tool_calls is not False
        if forced is not None:
            if not req.tools:
                raise APIError(f"tool_choice {req.tool_choice!r} needs tools", param="tool_choice")
            if guided_params(req)[0] is not None:
                raise APIError("a forced tool_choice cannot be combined with response_format or guided decoding "
                               "fields", param="tool_choice")
            if forced == "required":
                plan.guided = GuidedDecodingParams(json=required_schema(req.tools, parallel))
                plan.tool_parser = parse_json_array
            else:
                try:
                    schema = named_schema(req.tools, forced)
                except ValueError as exc:
                    raise APIError(str(exc), param="tool_choice") from None
                plan.guided = GuidedDecodingParams(json=schema)
                plan.tool_parser = named_parser(forced)
            plan.guided_param = "tools"
        elif req.tools and req.tool_choice in (None, "auto") and state.tool_call_parser:
            plan.tool_parser = get_parser(state.tool_call_parser)
            if state.tool_call_parser == "mistral":
                plan.skip_special_tokens = False  # [TOOL_CALLS] is a special token
        if plan.tool_parser is not None and not parallel:
            plan.max_calls = 1
        return plan

    def thinks(self, req: ChatCompletionRequest) -> bool:
        """Whether the reply is expected to reason first: always with ``deepseek_r1``; with
        ``qwen3`` unless ``chat_template_kwargs`` sets ``enable_thinking`` false."""
        if self.reasoning == "deepseek_r1":
            return True
        return self.reasoning == "qwen3" and (req.chat_template_kwargs or {}).get("enable_thinking", True) is not False

    @property
    def parses(self) -> bool:
        return self.tool_parser is not None or self.reasoning is not None

    def adjust(self, params, req: ChatCompletionRequest):
        """``params`` with the forced call's grammar and the decoding the parser needs."""
        changes = {}
        if self.guided is not None:
            changes["guided_decoding"] = self.guided
        gd = changes.get("guided_decoding", params.guided_decoding)
        if gd is not None and self.thinks(req):
            # the constraint applies to the answer: it starts once the reasoning has ended
            changes["guided_decoding"] = dataclasses.replace(gd, start_after="</think>")
        if self.skip_special_tokens is not None:
            changes["skip_special_tokens"] = self.skip_special_tokens
        return dataclasses.replace(params, **changes) if changes else params

    def message(self, text: str, finish_reason: Optional[str]) -> tuple[ChatResponseMessage, Optional[str]]:
        """The reply message of a whole ``text`` and its finish_reason ("tool_calls" when the model
        called tools and stopped by itself)."""
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = split_reasoning(self.reasoning, text)
        calls = []
        content: Optional[str] = text
        if self.tool_parser is not None:
            content, calls = extract_tool_calls(self.tool_parser, text, self.max_calls)
        msg = ChatResponseMessage(content=content, reasoning_content=reasoning,
                                  tool_calls=[ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                                              for c in calls] or None)
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return msg, finish_reason

    def stream(self) -> "ReplyStream":
        return ReplyStream(self)


class ReplyStream:
    """One streamed choice through the reasoning parser, then the tool-call parser: `feed` returns
    the `DeltaMessage` of a new piece of text (None when everything is held back for now), `finish`
    what is left at the end."""

    def __init__(self, plan: ReplyPlan) -> None:
        self.reasoning = ReasoningStream(plan.reasoning) if plan.reasoning is not None else None
        self.tools = ToolStream(plan.tool_parser, plan.max_calls) if plan.tool_parser is not None else None

    def feed(self, piece: str) -> Optional[DeltaMessage]:
        if self.reasoning is None and self.tools is None:
            return DeltaMessage(content=piece)
        r, c = self.reasoning.feed(piece) if self.reasoning is not None else ("", piece)
        return self._delta(r, c, final=False)

    def finish(self) -> Optional[DeltaMessage]:
        if self.reasoning is None and self.tools is None:
            return None
        r, c = self.reasoning.finish() if self.reasoning is not None else ("", "")
        return self._delta(r, c, final=True)

    def _delta(self, r: str, c: str, final: bool) -> Optional[DeltaMessage]:
        calls: list = []
        if self.tools is not None:
            content, calls = self.tools.feed(c) if c or not final else ("", [])
            if final:
                more, more_calls = self.tools.finish()
                content += more
                calls += more_calls
            c = content
        if not (r or c or calls):
            return None
        return DeltaMessage(reasoning_content=r or None, content=c or None, tool_calls=calls or None)

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if reason == "stop" and self.tools is not None and self.tools.called else reason
