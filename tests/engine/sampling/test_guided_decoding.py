"""Guided decoding on stories260K: every sampled output obeys its JSON schema, regex, choice list or
EBNF grammar; grammars compile once; bad constraints are refused before queueing; the sampler's mask
hook forbids exactly what the grammar forbids and leaves unguided rows and logprobs alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from kvpilot import KvCacheConfig
from kvpilot.llmapi import LLM, GuidedDecodingParams, SamplingParams
from kvpilot.sampling.guided import GuidedDecodingError, apply_guides
from kvpilot.sampling.sampler import Sampler, SamplingRow

PROMPT = "Once upon a time"

# 20 schemas: nested objects, arrays, enums, anyOf, string formats and lengths, numeric bounds. Every
# string and array is bounded so that a sampled document ends well within max_tokens.
S = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"pet": {"enum": ["cat", "dog", "bird"]}}, "required": ["pet"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "boolean"}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, S]}},
     "required": ["v"]},
    {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"]},
    {"type": "object", "properties": {"e": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.(com|org)$"}}, "required": ["e"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}}, "required": ["id"]},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}}, "required": ["s"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5}}, "required": ["x"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}}, "required": ["ok", "note"]},
    {"type": "object", "properties": {"p": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"k": {"enum": ["x", "y"]}, "n": {"type": "integer", "minimum": 1, "maximum": 3}},
        "required": ["k", "n"]}}}, "required": ["p"]},
    {"type": "object", "properties": {"c": {"const": "fixed"}}, "required": ["c"]},
    {"type": "object", "properties": {"u": {"oneOf": [{"type": "boolean"}, {"type": "null"}]}}, "required": ["u"]},
    {"type": "object", "properties": {"t": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"}}, "required": ["t"]},
    {"type": "object", "properties": {"m": {"type": "object", "properties": {"lo": {"type": "integer", "minimum": 0,
     "maximum": 5}, "hi": {"type": "integer", "minimum": 5, "maximum": 9}}, "required": ["lo", "hi"]}},
     "required": ["m"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "size": {"enum": [1, 2, 3]}},
     "required": ["color", "size"]},
    {"type": "object", "properties": {"w": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 3,
     "maxItems": 3}}, "required": ["w"]},
    {"type": "object", "properties": {"uuid": {"type": "string", "format": "uuid"}}, "required": ["uuid"]},
]
SEEDS = 10


def _format_checker() -> jsonschema.FormatChecker:
    """jsonschema's checks, but "date" as RFC 3339's full-date syntax: xgrammar's date grammar (like
    any regular language) cannot know that February has no 30th."""
    checker = jsonschema.FormatChecker()
    checker.checks("date")(lambda s: not isinstance(s, str) or bool(
        re.fullmatch(r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", s)))
    return checker


@pytest.fixture(scope="module")
def llm(stories_model_dir):
    with LLM(str(stories_model_dir), device="cpu", max_num_tokens=512, max_batch_size=256,
             kv_cache_config=KvCacheConfig(tokens_per_block=16)) as llm:
        yield llm


def _gen(llm, params):
    return [o.outputs[0] for o in llm.generate([PROMPT] * len(params), params, use_tqdm=False)]


def test_json_schema_200_sampled_outputs_validate(llm):
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=seed,
                             guided_decoding=GuidedDecodingParams(json=schema))
              for schema in SCHEMAS for seed in range(SEEDS)]
    outs = _gen(llm, params)
    assert len(outs) == 200
    for i, out in enumerate(outs):
        schema = SCHEMAS[i // SEEDS]
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema, format_checker=_format_checker())


def test_regex_choice_and_grammar_outputs_match(llm):
    regex = r"[a-z]{2,5}-\d{3}( [A-Z][a-z]{0,4})?"
    choices = ["yes", "no", "once upon a time"]
    grammar = 'root ::= "(" num (" + " num)? (" + " num)? ")"\nnum ::= [1-9] [0-9]?'
    params = ([SamplingParams(max_tokens=40, seed=s, guided_decoding=GuidedDecodingParams(regex=regex))
               for s in range(6)]
              + [SamplingParams(max_tokens=40, seed=s, n=2, guided_decoding=GuidedDecodingParams(choice=choices))
                 for s in range(4)]
              + [SamplingParams(max_tokens=60, seed=s, guided_decoding=GuidedDecodingParams(grammar=grammar))
                 for s in range(6)])
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    texts = [c.text for o in outs for c in o.outputs]
    reasons = {c.finish_reason for o in outs for c in o.outputs}
    assert reasons == {"stop"}
    for t in texts[:6]:
        assert re.fullmatch(regex, t), t
    for t in texts[6:14]:
        assert t in choices
    for t in texts[14:]:
        assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?){0,2}\)", t), t


def test_json_object_greedy_parses_and_grammar_end_stops_without_eos(llm):
    outs = _gen(llm, [SamplingParams(max_tokens=60, temperature=0.7, seed=s,
                                     guided_decoding=GuidedDecodingParams(json_object=True)) for s in range(4)])
    for out in outs:
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:  # an unbounded object may run out of tokens; what exists is still a JSON object's start
            assert out.text.startswith("{")
    # ignore_eos: the end token does not stop the sequence, the finished grammar does
    out = _gen(llm, [SamplingParams(max_tokens=30, ignore_eos=True, seed=0,
                                    guided_decoding=GuidedDecodingParams(choice=["ab", "cd"]))])[0]
    assert out.text in ("ab", "cd") and out.finish_reason == "stop" and len(out.token_ids) <= 4


def test_guided_and_plain_requests_share_batches(llm):
    plain = SamplingParams(max_tokens=24, temperature=0)
    base = _gen(llm, [plain])[0].text
    params = [plain, SamplingParams(max_tokens=24, guided_decoding=GuidedDecodingParams(regex=r"\d{4}"), seed=3), plain]
    outs = _gen(llm, params)
    assert outs[0].text == base and outs[2].text == base  # unguided rows unchanged by their neighbour
    assert re.fullmatch(r"\d{4}", outs[1].text)


def test_compile_once_and_errors_before_queueing(llm):
    backend = llm.guided_backend()
    schema = {"type": "object", "properties": {"q": {"type": "boolean"}}, "required": ["q"]}
    first = backend.compile(GuidedDecodingParams(json=schema))
    assert backend.compile(GuidedDecodingParams(json=json.dumps(schema))) is first  # same text, one compile
    waiting = len(llm._core.requests)
    cases = [(GuidedDecodingParams(regex="(ab"), "regex does not compile: .*parenthesis"),
             (GuidedDecodingParams(json={"type": "nope"}), "JSON schema does not compile: .*nope"),
             (GuidedDecodingParams(grammar="root ::= missing"), "EBNF grammar does not compile: .*missing"),
             (GuidedDecodingParams(structural_tag={"structures": [{"begin": "<a>"}]}), "structural tag")]
    for gd, pattern in cases:
        with pytest.raises(GuidedDecodingError, match=pattern):
            llm.generate_async(PROMPT, SamplingParams(guided_decoding=gd))
    assert len(llm._core.requests) == waiting
    with pytest.raises(ValueError, match="exactly one of"):
        GuidedDecodingParams(json=schema, regex="a")
    with pytest.raises(ValueError, match="exactly one of"):
        GuidedDecodingParams()
    with pytest.raises(TypeError, match="choice must be a list"):
        GuidedDecodingParams(choice="yes")
    with pytest.raises(ValueError, match="use_beam_search"):
        SamplingParams(use_beam_search=True, n=2, guided_decoding=GuidedDecodingParams(regex="a"))


def test_unknown_guided_decoding_backend_is_refused(stories_model_dir):
    with pytest.raises(ValueError, match="guided_decoding_backend must be one of"):
        LLM(str(stories_model_dir), device="cpu", guided_decoding_backend="outlines")


def test_structural_tag_constrains_only_the_tagged_region(llm):
    tag = {"structures": [{"begin": "<f>", "schema": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                         "required": ["x"]}, "end": "</f>"}], "triggers": ["<f>"]}
    compiled = llm.guided_backend().compile(GuidedDecodingParams(structural_tag=tag))
    ok = llm.guided_backend().guide(compiled)
    assert ok.matcher.accept_string('free text <f>{"x": 5}</f> more')
    bad = llm.guided_backend().guide(compiled)
    assert not bad.matcher.accept_string('text <f>{"y": 5}')


def test_sampler_hook_masks_guided_rows_only(llm):
    """apply_guides against a reference: allowed ids from the matcher, -inf elsewhere, unguided row
    and the input logits untouched; the greedy draw is the arg-max over allowed ids; logprobs raw."""
    backend = llm.guided_backend()
    guide = backend.guide(backend.compile(GuidedDecodingParams(regex=r"[0-9]+")))
    tok = llm.tokenizer
    V = llm.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, V, generator=g)
    rows = [SamplingRow(temperature=0.0, logprobs=1), SamplingRow(temperature=0.0, guide=guide, logprobs=1)]
    before = logits.clone()
    x = apply_guides(logits, logits, rows)
    assert torch.equal(logits, before) and torch.equal(x[0], before[0])
    allowed = torch.isfinite(x[1]).nonzero().flatten().tolist()
    assert allowed and all(re.fullmatch(r"[0-9]+", tok.decode([t]).strip() or "x") for t in allowed)
    digits = [t for t in range(V) if re.fullmatch(r"[0-9]+", tok.convert_ids_to_tokens([t])[0].lstrip("\u2581"))
              and not tok.convert_ids_to_tokens([t])[0].startswith("\u2581")]
    assert set(digits) <= set(allowed)
    out = Sampler()(logits, rows)
    assert out.token_ids[0] == int(before[0].argmax())
    assert out.token_ids[1] == max(allowed, key=lambda t: float(before[1, t]))
    ref_lp = torch.log_softmax(before[1], -1)[out.token_ids[1]]
    assert out.logprobs[1] == pytest.approx(float(ref_lp), abs=1e-5)


def test_start_after_leaves_text_free_until_the_marker(llm):
    """A reasoning model's answer: the grammar waits for the marker text (``</think>`` in serving),
    then constrains what follows. stories260K's greedy story names Lily within a few tokens."""
    free = _gen(llm, [SamplingParams(max_tokens=16, temperature=0)])[0].text
    assert "Lily" in free
    out = _gen(llm, [SamplingParams(max_tokens=40, temperature=0, guided_decoding=GuidedDecodingParams(
        choice=[" yes", " no"], start_after="Lily"))])[0]
    head = free[:free.index("Lily") + 4]
    assert out.text in (head + " yes", head + " no") and out.finish_reason == "stop"
