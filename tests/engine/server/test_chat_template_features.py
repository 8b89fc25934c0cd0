"""Chat templates with tools, documents, template kwargs, assistant prefill and ``echo``.

A tokenizer is built in the test (characters as tokens, ``<s>`` / ``</s>`` / ``<|im_start|>`` /
``<|im_end|>`` as special tokens) with a tool-use template written here (Qwen-style turns, a default
system prompt when the request has none, a tools block, a documents block, ``enable_thinking``,
assistant tool calls and tool results). kvpilot's rendering is compared with golden text and with
``transformers``' ``apply_chat_template`` on the same tokenizer and variables.
"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kvpilot.server.chat_template import RESERVED_TEMPLATE_KWARGS, load_chat_template, render_chat
from kvpilot.server.errors import APIError
from kvpilot.server.protocol import ChatCompletionRequest
from kvpilot.server.serving_chat import echo_text

NL = "{{ '\\n' }}"  # a newline right after a block tag (transformers renders with trim_blocks)
TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0].role != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>" + NL +
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}<|im_start|>system\n{{ m.content }}"
    "{% if tools %}" + NL + "# Tools{% for t in tools %}" + NL + "{{ t | tojson }}{% endfor %}{% endif %}"
    "{% if documents %}" + NL + "# Documents{% for d in documents %}" + NL +
    "[{{ loop.index }}] {{ d.title }}: {{ d.text }}{% endfor %}{% endif %}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }} {{ tc.function.arguments | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>tool\n[{{ m.tool_call_id }}] {{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant" + NL +
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
DOCS = [{"title": "Paris", "text": "Capital of France."}, {"title": "Rome", "text": "Capital of Italy."}]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|im_start|>": 3, "<|im_end|>": 4}
    vocab.update({c: i + 5 for i, c in enumerate(chars)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = TEMPLATE
    return fast


def _messages(*msgs):
    return ChatCompletionRequest.model_validate({"messages": list(msgs)}).messages


def _hf_ids(tokenizer, conversation, **kw):
    text = tokenizer.apply_chat_template(conversation, tokenize=False, **kw)
    return text, tokenizer.encode(text, add_special_tokens=False)


def test_tools_documents_and_thinking_match_transformers(tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    ids = render_chat(tokenizer, _messages(*msgs), None, True, {"enable_thinking": False},
                      tools=ChatCompletionRequest.model_validate({"messages": msgs, "tools": TOOLS}).tools,
                      documents=DOCS)
    text, want = _hf_ids(tokenizer, msgs, tools=TOOLS, documents=DOCS, add_generation_prompt=True,
                         enable_thinking=False)
    assert ids == want
    assert tokenizer.decode(ids) == text == (
        "<s><|im_start|>system\nBe brief.\n# Tools\n" + json.dumps(TOOLS[0]) + "\n# Documents\n"
        "[1] Paris: Capital of France.\n[2] Rome: Capital of Italy.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think></think>")
    assert ids[0] == 1 and ids.count(1) == 1  # the template's BOS, not a second one
    # enable_thinking left to the template's default: no empty think block.
    plain = render_chat(tokenizer, _messages(*msgs), None)
    assert tokenizer.decode(plain).endswith("<|im_start|>assistant\n")


def test_tool_calls_and_results_reach_the_template_as_transformers_expects(tokenizer):
    """OpenAI sends tool-call arguments as a JSON string; the template gets them as an object (what
    tool-use templates index into), exactly as transformers renders a dict."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    ids = render_chat(tokenizer, _messages(*msgs), None, True)
    hf_msgs = [msgs[0], {"role": "assistant", "content": "",
                         "tool_calls": [{**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               msgs[2]]
    text, want = _hf_ids(tokenizer, hf_msgs, add_generation_prompt=True)
    assert ids == want
    assert '<tool_call>get_weather {"city": "Paris"}</tool_call>' in text
    assert "<|im_start|>tool\n[call_1] sunny<|im_end|>" in text


def test_system_prompt_is_rendered_once(tokenizer):
    """The template's default system prompt applies only when the request has none; kvpilot adds none."""
    with_system = tokenizer.decode(render_chat(tokenizer, _messages({"role": "system", "content": "Be brief."},
                                                                    {"role": "user", "content": "hi"}), None))
    assert with_system.count("<|im_start|>system") == 1 and "helpful assistant" not in with_system
    default = tokenizer.decode(render_chat(tokenizer, _messages({"role": "user", "content": "hi"}), None))
    assert default.count("<|im_start|>system") == 1 and "You are a helpful assistant." in default


def test_continue_final_message_is_assistant_prefill(tokenizer):
    msgs = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1, 2,"}]
    ids = render_chat(tokenizer, _messages(*msgs), None, False, continue_final_message=True)
    text, want = _hf_ids(tokenizer, msgs, add_generation_prompt=False, continue_final_message=True)
    assert ids == want
    assert text.endswith("<|im_start|>assistant\n1, 2,")  # the turn left open, no <|im_end|>
    closed = tokenizer.decode(render_chat(tokenizer, _messages(*msgs), None, False))
    assert closed.endswith("1, 2,<|im_end|>\n")
    with pytest.raises(APIError) as e:
        render_chat(tokenizer, _messages(*msgs), None, True, continue_final_message=True)
    assert e.value.status == 400 and e.value.param == "continue_final_message"


def test_request_validation_of_the_new_fields():
    base = {"messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(ValidationError, match="continue_final_message and add_generation_prompt"):
        ChatCompletionRequest.model_validate({**base, "continue_final_message": True})
    ok = ChatCompletionRequest.model_validate({**base, "continue_final_message": True, "add_generation_prompt": False,
                                               "tools": TOOLS, "tool_choice": "auto", "documents": DOCS,
                                               "echo": True})
    assert ok.tools[0].function.name == "get_weather" and ok.documents == DOCS and ok.echo
    assert ok.tools[0].model_dump(exclude_none=True) == TOOLS[0]
    for forced, want in (("required", "required"),
                         ({"type": "function", "function": {"name": "get_weather"}}, "get_weather")):
        assert ChatCompletionRequest.model_validate({**base, "tools": TOOLS, "tool_choice": forced}).forced_tool() == want
    for bad in ("sometimes", {"type": "function"}, {"type": "function", "function": {"name": 3}}):
        with pytest.raises(ValidationError, match="tool_choice must be"):
            ChatCompletionRequest.model_validate({**base, "tools": TOOLS, "tool_choice": bad})
    with pytest.raises(ValidationError, match="name"):
        ChatCompletionRequest.model_validate({**base, "tools": [{"type": "function", "function": {}}]})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**base, "tools": [{"type": "retrieval", "function": {"name": "f"}}]})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**base, "echo": "yes"})


def test_reserved_template_kwargs_are_refused(tokenizer):
    msgs = _messages({"role": "user", "content": "x"})
    for key in ("add_generation_prompt", "tools", "messages", "tokenize"):
        assert key in RESERVED_TEMPLATE_KWARGS
        with pytest.raises(APIError) as e:
            render_chat(tokenizer, msgs, None, True, {key: True})
        assert e.value.status == 400 and e.value.param == "chat_template_kwargs" and key in e.value.message


def test_chat_template_flag_overrides_and_missing_template_is_400(tokenizer, tmp_path):
    msgs = _messages({"role": "user", "content": "hi"})
    f = tmp_path / "t.jinja"
    f.write_text("{{ bos_token }}[{% for m in messages %}{{ m.role }}={{ m.content }}{% endfor %}]")
    override = load_chat_template(str(f))
    assert tokenizer.decode(render_chat(tokenizer, msgs, override)) == "<s>[user=hi]"
    inline = load_chat_template("{% for m in messages %}{{ m.content | upper }}{% endfor %}")
    assert tokenizer.decode(render_chat(tokenizer, msgs, inline)) == "<s>HI"  # no BOS in the text: one added
    saved = tokenizer.chat_template
    tokenizer.chat_template = None
    try:
        with pytest.raises(APIError) as e:
            render_chat(tokenizer, msgs, None)
        assert e.value.status == 400 and e.value.code == "chat_template_missing" and "--chat-template" in e.value.message
        assert tokenizer.decode(render_chat(tokenizer, msgs, override)) == "<s>[user=hi]"  # the flag suffices
    finally:
        tokenizer.chat_template = saved


def test_echo_text_follows_vllm():
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "a"},
                                                             {"role": "assistant", "content": "Once upon"}],
                                                "echo": True, "add_generation_prompt": False,
                                                "continue_final_message": True})
    assert echo_text(req) == "Once upon"
    assert echo_text(req.model_copy(update={"echo": False})) == ""
    user_last = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "a"}], "echo": True})
    assert echo_text(user_last) == ""  # only a final assistant message is echoed


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_model_directory_template_is_used(tokenizer, tmp_path, where):
    """A model directory's own template, in ``chat_template.jinja`` or in ``tokenizer_config.json``'s
    ``chat_template``, reaches the engine's tokenizer (`kvpilot.llm._load_tokenizer`) and renders as
    transformers renders it."""
    from kvpilot.llm import _load_tokenizer

    saved = tokenizer.chat_template
    tokenizer.chat_template = None
    try:
        tokenizer.save_pretrained(tmp_path)
    finally:
        tokenizer.chat_template = saved
    if where == "chat_template.jinja":
        (tmp_path / where).write_text(TEMPLATE)
    else:
        cfg = json.loads((tmp_path / where).read_text())
        (tmp_path / where).write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    loaded = _load_tokenizer(tmp_path)
    msgs = [{"role": "user", "content": "hi"}]
    ids = render_chat(loaded, _messages(*msgs), None, True, {"enable_thinking": False})
    assert ids == _hf_ids(tokenizer, msgs, add_generation_prompt=True, enable_thinking=False)[1]
    assert loaded.decode(ids).endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think></think>")
