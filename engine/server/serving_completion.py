"""``POST /v1/completions``: prompts -> engine requests -> OpenAI completion bodies or SSE chunks.

Each prompt (string or token ids) is one engine request with ``n`` choices; choice ``i`` of prompt
``p`` is returned as index ``p * n + i`` (vLLM's convention). Strings are tokenized here (special
tokens added, as vLLM does for completions) so that the context limit is checked before anything is
queued, with OpenAI's wording.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, AsyncIterator, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvpilot.outputs import Logprob, RequestError, RequestOutput
from kvpilot.sampling_params import SamplingParams
from kvpilot.server.errors import APIError
from kvpilot.server.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                       CompletionStreamResponse, UsageInfo, random_id)
from kvpilot.server.sampling import check_context, compile_guided, completion_params, generation_defaults, guided_params
from kvpilot.server.state import ServerState
from kvpilot.server.streaming import (SSE_DONE, ChoiceDelta, EngineStreamingResponse, sse, stream_deltas, token_bytes,
                        token_text, until_disconnect, wait_all)

logger = logging.getLogger(__name__)


def check_model(state: ServerState, model: Optional[str]) -> str:
    """The model name the response carries: the served model's, or a LoRA adapter's
    (`ServerState.lora_modules`); a 404 when the client asked for any other model."""
    if model is None or model == state.served_model_name:
        return state.served_model_name
    if model in state.lora_modules:
        return model
    names = ", ".join(f"`{n}`" for n in [state.served_model_name, *state.lora_modules])
    raise APIError(f"The model `{model}` does not exist; this server serves {names}",
                   status=404, param="model", code="model_not_found")


def submit(llm: Any, prompts: list[list[int]], params: Any, streaming: bool,
           prompt_param: str = "prompt", max_tokens_param: str = "max_tokens",
           lora_request: Any = None) -> list[RequestOutput]:
    """Queue one engine request per prompt (with the LoRA adapter ``lora_request``, if not None).

    Raises:
        APIError: 400 when the engine refuses a prompt (after aborting those already queued; the
            ``param`` is ``max_tokens_param`` if the engine's message is about max_tokens, else
            ``prompt_param``), 503 when the engine is not running.
    """
    outputs: list[RequestOutput] = []
    try:
        for ids in prompts:
            if lora_request is None:
                outputs.append(llm.generate_async(ids, params, streaming=streaming))
            else:
                outputs.append(llm.generate_async(ids, params, streaming=streaming, lora_request=lora_request))
    except (ValueError, TypeError) as exc:
        for out in outputs:
            out.abort(wait=False)
        msg = str(exc)
        field = msg.split(" ", 1)[0]  # engine messages start with the field they are about
        if field in SamplingParams.field_names() and field != "max_tokens":
            param = field
        else:
            param = max_tokens_param if "max_tokens" in msg else prompt_param
        raise APIError(msg, param=param) from None
    except RuntimeError as exc:  # EngineDeadError: the engine loop has stopped
        for out in outputs:
            out.abort(wait=False)
        raise APIError(f"the engine is not running: {exc}", status=503) from None
    return outputs


class _LogprobWriter:
    """Builds the legacy ``logprobs`` object of one choice.

    ``text_offset`` is the character offset of each token in the choice's text (prompt tokens
    first when echoing): the running sum of the token strings' lengths, where a special token
    that the text leaves out (BOS, with ``skip_special_tokens``) adds nothing.

    ``top_logprobs`` is keyed by token string; when several tokens decode to the same string
    (byte-fallback pieces all showing U+FFFD), the later ones are keyed ``bytes:\\xNN...`` (their
    own bytes, OpenAI's form for text that is not valid UTF-8), or ``token_id:N`` if that is taken
    too, so that the dict always holds every alternative asked for.
    """

    def __init__(self, tokenizer: Any, offset: int = 0, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.offset = offset
        special = getattr(tokenizer, "all_special_ids", None) if skip_special_tokens else None
        self.silent = frozenset(special or ())

    def add(self, lp: CompletionLogprobs, token_ids: list[int],
            entries: list[Optional[dict[int, Logprob]]]) -> None:
        for tok, entry in zip(token_ids, entries):
            chosen = entry.get(tok) if entry else None
            text = token_text(self.tokenizer, tok, chosen)
            lp.tokens.append(text)
            lp.text_offset.append(self.offset)
            if tok not in self.silent:
                self.offset += len(text)
            lp.token_logprobs.append(chosen.logprob if chosen is not None else None)
            lp.top_logprobs.append(None if entry is None else self._top(entry))

    def _top(self, entry: dict[int, Logprob]) -> dict[str, float]:
        top: dict[str, float] = {}
        for t, v in entry.items():
            key = token_text(self.tokenizer, t, v)
            if key in top:
                key = "bytes:" + "".join(f"\\x{b:02x}" for b in token_bytes(self.tokenizer, t, key))
            if key in top:
                key = f"token_id:{t}"
            top[key] = v.logprob
        return top


def _prompt_logprobs_body(out: RequestOutput) -> Optional[list[Optional[dict[str, dict[str, Any]]]]]:
    """vLLM's ``prompt_logprobs`` of a choice: per prompt token (the first None) {token id: {logprob,
    rank, decoded_token}}."""
    if out.prompt_logprobs is None:
        return None
    return [None if e is None else {str(t): {"logprob": v.logprob, "rank": v.rank, "decoded_token": v.decoded_token}
                                    for t, v in e.items()} for e in out.prompt_logprobs]


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request) -> Response:
    """Serve one completions request (streaming or not). Raises `APIError` for bad input."""
    llm = state.llm
    model = check_model(state, req.model)
    tokenizer = llm.tokenizer
    if req.stream and req.best_of is not None and req.best_of > (req.n or 1):
        raise APIError("best_of > n cannot be streamed", param="best_of")
    if req.echo and tokenizer is None:
        raise APIError("echo needs a tokenizer; this server runs without one", param="echo")
    prompt_ids: list[list[int]] = []
    prompt_texts: list[Optional[str]] = []
    for p in req.prompts():
        if isinstance(p, str):
            if tokenizer is None:
                raise APIError("this server has no tokenizer; send the prompt as token ids", param="prompt")
            prompt_ids.append(list(tokenizer.encode(p, add_special_tokens=req.add_special_tokens)))
            prompt_texts.append(p)
        else:
            prompt_ids.append(list(p))
            prompt_texts.append(None)
    # One SamplingParams for all prompts: without max_tokens, what is left after the longest prompt.
    max_tokens = min(check_context(len(ids), req.max_tokens, llm.max_seq_len, "max_tokens") for ids in prompt_ids)
    params = completion_params(req, max_tokens, generation_defaults(llm))
    await compile_guided(llm, params, guided_params(req)[1])
    if req.echo:
        # A token-id prompt is echoed as its text, without the special tokens (BOS) the text of a
        # string prompt does not hold either.
        prompt_texts = [t if t is not None else tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)
                        for t, ids in zip(prompt_texts, prompt_ids)]
    request_id = random_id("cmpl")
    outputs = submit(llm, prompt_ids, params, streaming=bool(req.stream), lora_request=state.lora_request(model))
    if req.stream:
        return EngineStreamingResponse(_stream(state, req, model, request_id, outputs, prompt_ids, prompt_texts),
                                       state, outputs)
    state.begin()
    try:
        with state.tracking(outputs):
            finished = await until_disconnect(raw, wait_all(outputs))
    except RequestError as exc:
        raise APIError(f"generation failed: {exc}", status=500) from None
    finally:
        state.end()
    return JSONResponse(_full_response(req, model, request_id, finished, prompt_ids, prompt_texts, tokenizer)
                        .model_dump())


def _full_response(req: CompletionRequest, model: str, request_id: str, finished: list[RequestOutput],
                   prompt_ids: list[list[int]], prompt_texts: list[Optional[str]], tokenizer: Any
                   ) -> CompletionResponse:
    n = params_n(req)
    choices = []
    completion_tokens = 0
    for p, out in enumerate(finished):
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            prefix = prompt_texts[p] if req.echo else ""
            lp = None
            if req.logprobs is not None:
                lp = CompletionLogprobs()
                writer = _LogprobWriter(tokenizer, skip_special_tokens=req.skip_special_tokens)
                if req.echo:
                    writer.add(lp, prompt_ids[p], _prompt_entries(out, len(prompt_ids[p])))
                writer.add(lp, c.token_ids, c.logprobs)
            choices.append(CompletionChoice(index=p * n + c.index, text=prefix + c.text, logprobs=lp,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                            prompt_logprobs=_prompt_logprobs_body(out)
                                            if req.prompt_logprobs is not None else None))
    usage = UsageInfo.of(sum(len(o.prompt_token_ids) for o in finished), completion_tokens)
    return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)


def params_n(req: Union[CompletionRequest, Any]) -> int:
    return 1 if req.n is None else req.n


def _prompt_entries(out: RequestOutput, num_prompt_tokens: int) -> list[Optional[dict[int, Logprob]]]:
    entries = list(out.prompt_logprobs or [])
    return (entries + [None] * num_prompt_tokens)[:num_prompt_tokens]


async def _stream(state: ServerState, req: CompletionRequest, model: str, request_id: str,
                  outputs: list[RequestOutput], prompt_ids: list[list[int]],
                  prompt_texts: list[Optional[str]]) -> AsyncIterator[str]:
    tokenizer = state.llm.tokenizer
    n = params_n(req)
    include_usage = req.include_usage
    writers: dict[int, _LogprobWriter] = {}
    completion_tokens = 0
    created = int(time.time())  # one id and one creation time for every chunk of the stream (OpenAI)

    def chunk(choice: CompletionChoice) -> str:
        body = CompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice])
        return sse(body.model_dump_json(exclude=None if include_usage else {"usage"}))

    try:
        async for deltas in stream_deltas(outputs):
            for d in deltas:
                completion_tokens += len(d.token_ids)
                for piece in _choice_chunks(req, d, n, writers, tokenizer, outputs, prompt_ids, prompt_texts):
                    yield chunk(piece)
        if include_usage:
            usage = UsageInfo.of(sum(len(o.prompt_token_ids) for o in outputs), completion_tokens)
            yield sse(CompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                               usage=usage).model_dump_json())
        yield SSE_DONE
    except RequestError as exc:
        logger.error("request %s failed: %s", request_id, exc)
        yield sse(json.dumps(APIError(f"generation failed: {exc}", status=500).body()))
        yield SSE_DONE


def _choice_chunks(req: CompletionRequest, d: ChoiceDelta, n: int, writers: dict[int, _LogprobWriter],
                   tokenizer: Any, outputs: list[RequestOutput], prompt_ids: list[list[int]],
                   prompt_texts: list[Optional[str]]) -> list[CompletionChoice]:
    """The SSE choices for one delta: its text (echo first, on a choice's first chunk), then a
    separate empty chunk carrying ``finish_reason`` so that it is null on every other chunk."""
    index = d.prompt_index * n + d.index
    text = d.text
    lp = None
    first = index not in writers
    if first:
        writers[index] = _LogprobWriter(tokenizer, skip_special_tokens=req.skip_special_tokens)
    writer = writers[index]
    if req.logprobs is not None:
        lp = CompletionLogprobs()
    if first and req.echo:
        prefix = prompt_texts[d.prompt_index] or ""
        if lp is not None:
            ids = prompt_ids[d.prompt_index]
            writer.add(lp, ids, _prompt_entries(outputs[d.prompt_index], len(ids)))
        text = prefix + text
    if lp is not None:
        writer.add(lp, d.token_ids, d.logprobs)
    pieces = []
    if text or d.token_ids or (first and req.echo):
        pieces.append(CompletionChoice(index=index, text=text, logprobs=lp))
    if d.finish_reason is not None:
        pieces.append(CompletionChoice(index=index, text="", finish_reason=d.finish_reason,
                                       stop_reason=d.stop_reason))
    return pieces
