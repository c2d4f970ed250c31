"""Tool calling and reasoning output (issue 34): every parser on fixed model outputs, whole
and streamed one character at a time; constraints gated on the end of the reasoning; tools
through the server with the openai client."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from moestream.reasoning import get_reasoning_parser
from moestream.server.chat_output import ChatOutputParser
from moestream.server.tool_parsers import NamedFunctionParser, RequiredParser, make_tool_parser

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]

# parser -> (model output, reasoning, content, [(name, arguments, id or None)])
CASES = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>',
               None, "Let me check.\n", [("get_weather", '{"city": "Paris", "days": 2}', None),
                                        ("get_time", "{}", None)]),
    "deepseek_v3": ('Sure<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                    '{"city": "Beijing"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
                    '```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                    None, "Sure", [("get_weather", '{"city": "Beijing"}', None), ("get_time", "{}", None)]),
    "kimi_k2": ('ok<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1 <|tool_call_argument_begin|>'
                ' {} <|tool_call_end|><|tool_calls_section_end|>',
                None, "ok", [("get_weather", '{"city": "Paris"}', "functions.get_weather:0"),
                             ("get_time", "{}", "functions.get_time:1")]),
    "glm45": ('hm<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>1984</arg_value>\n<arg_key>days</arg_key>\n'
              '<arg_value>3</arg_value>\n</tool_call>',  # city is a string in the schema: "1984" stays a string
              None, "hm", [("get_weather", '{"city": "1984", "days": 3}', None)]),
    "openai": ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
               'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
               "Need the weather.", None, [("get_weather", '{"city": "Paris"}', None)]),
}


def whole_and_streamed(parser: ChatOutputParser, fresh: ChatOutputParser, text: str) -> tuple[tuple, tuple]:
    """(reasoning, content, [(name, arguments, id)]) of `text` parsed whole, and of the
    deltas of `text` streamed one character at a time, added up."""
    m, calls = parser.whole(text)
    whole = (m.reasoning, m.content, [(c.function.name, c.function.arguments, c.id) for c in calls])
    reasoning = content = ""
    streamed: list[list] = []
    for i in range(1, len(text) + 1):
        d = fresh.delta(text[:i], i == len(text))
        reasoning, content = reasoning + d.reasoning, content + d.content
        for t in d.tool_calls:
            if t.id is not None:
                assert t.index == len(streamed) and t.type == "function" and t.function.name
                streamed.append([t.function.name, "", t.id])
            streamed[t.index][1] += t.function.arguments or ""
    return whole, (reasoning or None, content or None, [tuple(c) for c in streamed])


@pytest.mark.parametrize("name", sorted(CASES))
def test_tool_parsers_whole_and_streamed(name: str) -> None:
    text, reasoning, content, expected = CASES[name]
    rp = get_reasoning_parser("openai_gptoss") if name == "openai" else None
    whole, streamed = whole_and_streamed(ChatOutputParser(rp, make_tool_parser(name, TOOLS)),
                                         ChatOutputParser(rp, make_tool_parser(name, TOOLS)), text)
    for got in (whole, streamed):
        assert got[:2] == (reasoning, content)
        assert [(n, a) for n, a, _ in got[2]] == [(n, a) for n, a, _ in expected]
        for (_, _, call_id), (_, _, want) in zip(got[2], expected):
            assert call_id == want if want else call_id.startswith("chatcmpl-tool-")
        for n, a, _ in got[2]:  # the arguments validate against the function's schema
            jsonschema.validate(json.loads(a), next(t for t in TOOLS if t["function"]["name"] == n)["function"]["parameters"])


@pytest.mark.parametrize("name,text", [
    ("hermes", 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'),  # bad JSON
    ("hermes", "No call here, only <tool_ text."),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function get_weather<｜tool▁call▁end｜>"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>get_weather<|tool_call_end|>"),
])
def test_malformed_calls_are_content(name: str, text: str) -> None:
    m, calls = ChatOutputParser(None, make_tool_parser(name, TOOLS)).whole(text)
    assert (m.content, calls) == (text, [])


def test_a_streamed_call_that_turns_out_malformed_is_not_sent_again_as_content() -> None:
    """Regression: the stream had sent the call with the end marker in its arguments, then the
    whole raw text as content, and finish_reason tool_calls."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
    whole, streamed = whole_and_streamed(ChatOutputParser(None, make_tool_parser("hermes", TOOLS)),
                                         fresh := ChatOutputParser(None, make_tool_parser("hermes", TOOLS)), text)
    assert whole == (None, text, [])
    assert streamed[1] is None and [n for n, _, _ in streamed[2]] == ["get_weather"] and "<" not in streamed[2][0][1]
    assert fresh.num_calls == 0  # so the stream's finish_reason is the whole response's


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = CASES["hermes"][0]
    whole, streamed = whole_and_streamed(ChatOutputParser(None, make_tool_parser("hermes", TOOLS), max_calls=1),
                                         ChatOutputParser(None, make_tool_parser("hermes", TOOLS), max_calls=1), text)
    assert [(n, a) for n, a, _ in whole[2]] == [(n, a) for n, a, _ in streamed[2]] == [
        ("get_weather", '{"city": "Paris", "days": 2}')]


def test_required_and_named_outputs() -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    whole, streamed = whole_and_streamed(ChatOutputParser(None, RequiredParser()),
                                         ChatOutputParser(None, RequiredParser()), text)
    for got in (whole, streamed):
        assert (got[0], got[1], [(n, a) for n, a, _ in got[2]]) == (
            None, None, [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")])
    whole, streamed = whole_and_streamed(ChatOutputParser(None, NamedFunctionParser("get_weather")),
                                         ChatOutputParser(None, NamedFunctionParser("get_weather")), ' {"city": "Rome"} ')
    assert whole[2][0][:2] == streamed[2][0][:2] == ("get_weather", '{"city": "Rome"}')
    # cut by max_tokens: a whole output keeps its finished calls only; a named function that
    # wrote nothing (still thinking) made no call
    cut = RequiredParser().parse('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"ci',
                                 True)
    assert [(c.name, c.arguments) for c in cut.tool_calls] == [("get_time", "{}")]
    assert NamedFunctionParser("get_time").parse("  ", True).tool_calls == ()


@pytest.mark.parametrize("name,text,reasoning,content", [
    ("qwen3", "<think>\nI should greet.\n</think>\n\nHello!", "\nI should greet.\n", "\n\nHello!"),
    ("qwen3", "I should greet.</think>Hello!", "I should greet.", "Hello!"),  # <think> opened by the template
    ("deepseek_r1", "Thinking about </thin", "Thinking about </thin", None),  # cut by max_tokens: all reasoning
    ("deepseek_r1", "</think>Only an answer.", None, "Only an answer."),
    ("glm45", "<think>Plan.</think>Answer.", "Plan.", "Answer."),
    ("glm45", "Answer without thinking.", None, "Answer without thinking."),
    ("glm45", "<think>Cut short", "Cut short", None),
    ("openai_gptoss", "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
     "Think.", "Done."),
    ("openai_gptoss", "<|channel|>analysis<|message|>Cut", "Cut", None),
])
def test_reasoning_parsers_whole_and_streamed(name: str, text: str, reasoning: str | None, content: str | None) -> None:
    rp = get_reasoning_parser(name)
    whole, streamed = whole_and_streamed(ChatOutputParser(rp, None), ChatOutputParser(rp, None), text)
    assert whole == streamed == (reasoning, content, [])


def test_reasoning_then_hermes_tool_call() -> None:
    text = '<think>Use the tool.</think>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    rp = get_reasoning_parser("qwen3")
    whole, streamed = whole_and_streamed(ChatOutputParser(rp, make_tool_parser("hermes", TOOLS)),
                                         ChatOutputParser(rp, make_tool_parser("hermes", TOOLS)), text)
    for got in (whole, streamed):
        assert (got[0], got[1], [(n, a) for n, a, _ in got[2]]) == ("Use the tool.", "\n", [("get_time", "{}")])


def test_unknown_parsers_are_refused() -> None:
    from moestream.server.serving import ServerConfig

    with pytest.raises(ValueError, match="reasoning_parser 'qwen9' is unknown; choose one of qwen3"):
        get_reasoning_parser("qwen9")
    with pytest.raises(ValueError, match="tool call parser 'llama9' is unknown"):
        ServerConfig(served_model_names=("m",), tool_call_parser="llama9")
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        ServerConfig(served_model_names=("m",), enable_auto_tool_choice=True)


# ---- through the server ----------------------------------------------------------------------

# A chat template with tools and Qwen3's thinking switch: the prompt opens a think block, or
# closes it at once when chat_template_kwargs has enable_thinking false.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{% endif %}{% endif %}")
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
DEEP: dict = {"type": "string"}
for _ in range(900):  # deeper than the chat template's renderer can recurse (was a 500)
    DEEP = {"type": "array", "items": DEEP}


@pytest.fixture(scope="module")
def tools_server(qwen3_moe_dir: str):
    """The tiny Qwen3-MoE with the tools template, the qwen3 reasoning parser, the hermes tool
    parser and auto tool choice, compact JSON."""
    from live_server import LiveServer

    from moestream import EngineConfig
    from moestream.server.serving import ServerConfig

    server = LiveServer(EngineConfig(model=qwen3_moe_dir, dtype="float32", max_model_len=384, reasoning_parser="qwen3",
                                     structured_outputs_config={"disable_any_whitespace": True}),
                        ServerConfig(served_model_names=("m",), chat_template=TOOLS_TEMPLATE, tool_call_parser="hermes",
                                     enable_auto_tool_choice=True))
    yield server
    server.stop()


def _streamed_calls(stream) -> tuple[list[tuple[str, str]], str | None, str]:
    calls: list[list[str]] = []
    finish, reasoning = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            d = choice.delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            for t in d.tool_calls or []:
                if t.id is not None:
                    calls.append([t.function.name, ""])
                calls[t.index][1] += t.function.arguments or ""
            finish = choice.finish_reason or finish
    return [tuple(c) for c in calls], finish, reasoning


def test_openai_client_tool_calls_required_and_named(tools_server) -> None:
    import openai

    client = openai.OpenAI(base_url=tools_server.base_url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model="m", messages=messages, tools=TOOLS, max_tokens=80, temperature=0.9, seed=3, extra_body=NO_THINKING,
              parallel_tool_calls=False)  # one call: a random model may go on calling until max_tokens
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice, finish in [("required", "tool_calls"), ({"type": "function", "function": {"name": "get_weather"}}, "stop")]:
        r = client.chat.completions.create(tool_choice=choice, **kw)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == finish and msg.content is None and msg.reasoning_content is None
        assert msg.tool_calls and all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in msg.tool_calls)
        for c in msg.tool_calls:
            jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
        assert len(msg.tool_calls) == 1 and (choice == "required" or msg.tool_calls[0].function.name == "get_weather")
        calls, stream_finish, _ = _streamed_calls(client.chat.completions.create(tool_choice=choice, stream=True, **kw))
        assert (calls, stream_finish) == ([(c.function.name, c.function.arguments) for c in msg.tool_calls], finish)
    # the conversation goes on: the call and its result are sent back through the template
    call = msg.tool_calls[0]
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = client.chat.completions.create(model="m", messages=follow, tools=TOOLS, tool_choice="none", max_tokens=4,
                                       temperature=0, extra_body=NO_THINKING)
    assert r.choices[0].message.tool_calls == [] and r.choices[0].message.content
    tools_server.wait_idle()


def test_auto_tool_choice_parses_the_models_own_calls_whole_and_streamed(tools_server) -> None:
    """tool_choice auto with the hermes parser: the output is forced (a regex) to text and a
    call in hermes syntax, which comes back as content and a tool call, whole and streamed."""
    import openai

    client = openai.OpenAI(base_url=tools_server.base_url + "/v1", api_key="none")
    forced = r'Sure\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "Oslo", "days": 2\}\}</tool_call>'
    kw = dict(model="m", messages=[{"role": "user", "content": "Oslo?"}], tools=TOOLS, max_tokens=60, temperature=0,
              extra_body={"guided_regex": forced, **NO_THINKING})
    msg = client.chat.completions.create(**kw).choices[0]
    assert msg.finish_reason == "tool_calls" and msg.message.content == "Sure."
    assert [(c.function.name, c.function.arguments) for c in msg.message.tool_calls] == [
        ("get_weather", '{"city": "Oslo", "days": 2}')]
    content, calls = "", []
    for chunk in client.chat.completions.create(stream=True, **kw):
        content += chunk.choices[0].delta.content or ""
        for t in chunk.choices[0].delta.tool_calls or []:
            calls.append([t.function.name, ""]) if t.id else None
            calls[t.index][1] += t.function.arguments or ""
    assert (content, calls) == ("Sure.", [["get_weather", '{"city": "Oslo", "days": 2}']])
    tools_server.wait_idle()


def test_reasoning_content_and_constraints_wait_for_the_end_of_reasoning(tools_server) -> None:
    """With thinking on, the tiny model never writes </think> within max_tokens: the output is
    all reasoning, and a regex constraint leaves it unchanged (it applies after the reasoning);
    with thinking off the same constraint holds from the first token."""
    import openai

    client = openai.OpenAI(base_url=tools_server.base_url + "/v1", api_key="none")
    kw = dict(model="m", messages=[{"role": "user", "content": "Think."}], max_tokens=12, temperature=0)
    free = client.chat.completions.create(**kw).choices[0].message
    assert free.content is None and free.reasoning_content and "</think>" not in free.reasoning_content
    gated = client.chat.completions.create(extra_body={"guided_regex": "[0-9]{4}"}, **kw).choices[0].message
    assert (gated.reasoning_content, gated.content) == (free.reasoning_content, None)
    streamed = _streamed_calls(client.chat.completions.create(stream=True, **kw))[2]
    assert streamed == free.reasoning_content
    off = client.chat.completions.create(extra_body={"guided_regex": "[0-9]{4}", **NO_THINKING}, **kw).choices[0].message
    assert off.reasoning_content is None and len(off.content) == 4 and off.content.isdigit()
    # top_logprobs of a constrained output: masked tokens are -inf, written as -9999.0 (was a 500)
    for stream in (False, True):
        r = tools_server.post("/v1/chat/completions", json={
            "messages": kw["messages"], "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 3,
            "stream": stream, "guided_choice": ["yes", "no"], **NO_THINKING})
        assert r.status_code == 200, r.text
        values = [float(v) for v in re.findall(r'"logprob":\s*(-?[0-9.e+-]+|null)', r.text) if v != "null"]
        assert values and min(values) == -9999.0 and "null" not in re.findall(r'"logprob":\s*(null)', r.text)
    tools_server.wait_idle()


@pytest.mark.parametrize("body,param,message", [
    ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}],
      "tool_choice": "required"}, "tools", "parameters schema"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "same name"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "pattern"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "may not set tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]}, "tools", "nested too deeply"),
])
def test_bad_tool_fields_are_400(tools_server, body: dict, param: str, message: str | None) -> None:
    r = tools_server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and (message is None or message in error["message"]), error
    assert tools_server.get("/health").status_code == 200


def test_tool_choice_none_needs_no_server_flags(live_server) -> None:
    """(Without the flags, tools and no tool_choice are a 400: test_server_errors.BAD_REQUESTS.)"""
    from conftest import API_KEY

    r = live_server.post("/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                         json={"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "none",
                               "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"] == []
