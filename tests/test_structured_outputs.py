"""Structured outputs offline (`SamplingParams(structured_outputs=StructuredOutputsParams(...))`,
llguidance backend) on the demo model: JSON-schema outputs validate; regex, choice and GBNF
outputs match; constrained requests batched with unconstrained ones leave those unchanged;
preemption and prefix hits leave constrained outputs unchanged; bad constraints are refused
before anything is queued."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from moestream import LLM, SamplingParams
from moestream.demo import demo_model_path
from moestream.engine.kv_cache import kv_block_bytes
from moestream.models.hf_config import model_config_from_hf
from moestream.structured_output.params import StructuredOutputsParams as SO

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "kind": {"enum": ["module", "class", "function"]},
        "args": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                 "minItems": 1, "maxItems": 3},
        "meta": {"type": "object", "properties": {"public": {"type": "boolean"}}, "required": ["public"],
                 "additionalProperties": False},
    },
    "required": ["name", "kind", "args", "meta"],
    "additionalProperties": False,
}
PROMPTS = ["def parse(path):", "import os\n", "class Stack:", "# utilities", "return self.", "for i in range(",
           "x = {", "print(", "with open(", "    def __init__", "try:\n", "lambda x:", "if __name__", "@property",
           "from collections import", "raise ValueError("]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(demo_model_path(), dtype="float32", max_model_len=256)


def test_json_schema_outputs_validate_and_leave_unconstrained_rows_unchanged(llm: LLM) -> None:
    constrained = SamplingParams(temperature=0, max_tokens=96, structured_outputs=SO(json=SCHEMA,
                                                                                     disable_any_whitespace=True))
    plain = SamplingParams(temperature=0, max_tokens=24)
    alone = [o.outputs[0].text for o in llm.generate(PROMPTS[:4], plain)]
    outs = llm.generate(PROMPTS + PROMPTS[:4], [constrained] * len(PROMPTS) + [plain] * 4)
    for o in outs[:len(PROMPTS)]:
        text = o.outputs[0].text
        assert o.outputs[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
        assert json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False) == text  # compact
    assert [o.outputs[0].text for o in outs[len(PROMPTS):]] == alone
    assert not llm.llm_engine.requests


def test_regex_choice_and_grammar(llm: LLM) -> None:
    regex = r"[0-9]{1,4}\.[0-9]{2}"
    choices = ["yes", "no", "maybe later"]
    params = [
        SamplingParams(temperature=0, max_tokens=20, structured_outputs=SO(regex=regex)),
        SamplingParams(temperature=0.9, seed=3, max_tokens=20, structured_outputs=SO(choice=choices)),
        SamplingParams(temperature=0, max_tokens=20, structured_outputs=SO(grammar='root ::= "(" [0-9]+ ")"')),
        SamplingParams(temperature=0, max_tokens=20, structured_outputs=SO(grammar='start: "[" WORD "]"\n%import common.WORD')),
        SamplingParams(temperature=0.7, seed=1, max_tokens=40, structured_outputs=SO(json_object=True)),
    ]
    texts = [o.outputs[0].text for o in llm.generate(["x = ", "The answer: ", "n = ", "tag ", "cfg = "], params)]
    assert re.fullmatch(regex, texts[0]), texts[0]
    assert texts[1] in choices
    assert re.fullmatch(r"\([0-9]+\)", texts[2]), texts[2]
    assert re.fullmatch(r"\[[A-Za-z]+\]", texts[3]), texts[3]
    assert isinstance(json.loads(texts[4]), dict), texts[4]


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer",
        "minimum": 1, "maximum": 9}}, "required": ["city", "days"], "additionalProperties": False}


def test_structural_tag_constrains_only_what_follows_a_trigger(llm: LLM) -> None:
    """vLLM's structural_tag: free text, then the schema after `begin`, then `end`. The
    trigger is the text the model writes first anyway (greedy), so the tag opens at once."""
    prompt = "def parse(path):"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0]
    trigger = llm.get_tokenizer().decode(free.token_ids[:1])
    tag = {"structures": [{"begin": trigger + "<get>", "schema": CITY, "end": "</get>"}], "triggers": [trigger]}
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=SO(structural_tag=tag,
                                                                                disable_any_whitespace=True))
    text = llm.generate([prompt], params)[0].outputs[0].text
    begin = text.index(trigger + "<get>")
    assert text[:begin] == "", text  # the model's own first token is the trigger
    assert "</get>" in text, text
    args = text[len(trigger + "<get>"):].split("</get>", 1)[0]
    jsonschema.validate(json.loads(args), CITY)
    assert json.dumps(json.loads(args), separators=(",", ":")) == args  # compact inside the tag too


@pytest.mark.parametrize("special", [True, False])
def test_structural_tag_trigger_as_a_special_token_or_as_text(special: bool) -> None:
    """A `<tool_call>` trigger is matched as the special token when the tokenizer has one
    (Qwen3, Hermes), else as text; either way the arguments follow the schema."""
    from transformers import AutoTokenizer

    from moestream.structured_output.guidance import GuidanceBackend

    tok = AutoTokenizer.from_pretrained(demo_model_path())
    if special:
        tok.add_special_tokens({"additional_special_tokens": ["<tool_call>"]})
    backend = GuidanceBackend(tok, len(tok))
    tag = SO(structural_tag={"structures": [{"begin": '<tool_call>{"name": "get", "arguments": ', "schema": CITY,
                                             "end": "}</tool_call>"}], "triggers": ["<tool_call>"]})

    def accepts(text: str) -> bool:
        m = backend.matcher(tag)
        return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False))

    call = '<tool_call>{"name": "get", "arguments": {"city": "Rome", "days": 2}}</tool_call>'
    assert (len(tok.encode("<tool_call>", add_special_tokens=False)) == 1) == special
    assert accepts("Let me look. " + call + " Done.")
    assert not accepts('Let me look. <tool_call>{"name": "get", "arguments": {"city": "Oslo"')
    assert accepts("No call at all, just text <tool_ca")


def test_whitespace_pattern_sets_what_json_may_hold_between_tokens(llm: LLM) -> None:
    backend = llm.llm_engine.grammar_backend
    tok = llm.get_tokenizer()

    def accepts(params: SO, text: str) -> bool:
        m = backend.matcher(params)
        return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False))

    one_space = SO(json=CITY, whitespace_pattern="[ ]?")
    assert accepts(one_space, '{ "city": "Rome", "days": 3 }')
    assert not accepts(one_space, '{\n"city"')
    assert not accepts(one_space, '{  "city"')  # two spaces
    assert accepts(SO(json=CITY), '{\n  "city"')  # the default allows any whitespace
    assert not accepts(SO(json=CITY, whitespace_pattern="[ ]?", disable_any_whitespace=True), '{ "city"')
    out = llm.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=40, structured_outputs=one_space))
    for o in out:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), CITY)
        assert not re.search(r"[\n\t]|  ", o.outputs[0].text), o.outputs[0].text


def test_constrained_outputs_survive_preemption_chunked_prefill_and_prefix_hits() -> None:
    """A tight KV cache (preemptions), 8-token steps (prompts prefilled in chunks) and a
    second round that hits the prefix cache give the unconstrained-engine run's outputs."""
    constrained = SamplingParams(temperature=0, max_tokens=64, structured_outputs=SO(json=SCHEMA,
                                                                                     disable_any_whitespace=True))
    prompts = [p * 6 for p in PROMPTS[:8]]  # at least one full KV block each
    ref = [o.outputs[0].text for o in LLM(demo_model_path(), dtype="float32", max_model_len=128,
                                          enable_prefix_caching=False).generate(prompts, constrained)]
    mc = model_config_from_hf(demo_model_path())
    block = kv_block_bytes(mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, torch.float32)
    tight = LLM(demo_model_path(), dtype="float32", max_model_len=128, kv_cache_memory_bytes=10 * block,
                max_num_batched_tokens=8)
    assert max(len(tight.get_tokenizer().encode(p)) for p in prompts) > 8  # some prompts take several chunks
    for _ in range(2):  # the second run hits the prefix cache
        assert [o.outputs[0].text for o in tight.generate(prompts, constrained)] == ref
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert tight.prefix_cache_stats()["hits"] > 0


def test_bad_constraints_are_refused_before_anything_is_queued(llm: LLM) -> None:
    ok = SamplingParams(max_tokens=2)
    for so, message in [
        (SO(regex="[a-"), "structured_outputs.regex does not compile: .*unclosed character class"),
        (SO(json={"type": "objekt"}), "structured_outputs.json does not compile"),
        (SO(grammar="root ::= (("), "structured_outputs.grammar does not compile"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.generate(["a", "b"], [ok, SamplingParams(structured_outputs=so)])
        assert not llm.llm_engine.requests
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object, structural_tag; got json, regex"):
        SO(json={}, regex="a")
    with pytest.raises(ValueError, match="structured_outputs must be None or a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})


# ---- through the server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def compact_server(qwen3_moe_dir: str):
    """The tiny Qwen3-MoE (a chat template) served with `--structured-outputs-config
    '{"disable_any_whitespace": true}'`: a random model under a grammar that allows any
    whitespace can emit it until max_tokens runs out."""
    from live_server import LiveServer

    from moestream import EngineConfig
    from moestream.server.serving import ServerConfig

    server = LiveServer(EngineConfig(model=qwen3_moe_dir, dtype="float32", max_model_len=256,
                                     structured_outputs_config={"disable_any_whitespace": True}),
                        ServerConfig(served_model_names=("m",)))
    yield server
    server.stop()


def test_openai_client_structured_outputs(compact_server) -> None:
    import openai
    import pydantic

    class Step(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=8)
        kind: str = pydantic.Field(pattern="^(add|remove)$")
        count: int = pydantic.Field(ge=0, le=99)
        tags: list[pydantic.constr(max_length=6)] = pydantic.Field(min_length=1, max_length=2)

    client = openai.OpenAI(base_url=compact_server.base_url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "Give me a step."}]
    for seed in range(3):
        r = client.beta.chat.completions.parse(model="m", messages=messages, response_format=Step, max_tokens=120,
                                               temperature=1.0, seed=seed)
        step = r.choices[0].message.parsed
        assert isinstance(step, Step) and json.loads(r.choices[0].message.content) == step.model_dump()
        assert "\n" not in r.choices[0].message.content  # compact (--structured-outputs-config)

    r = client.completions.create(model="m", prompt="x", max_tokens=96, temperature=0, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    for extra, check in [
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
        ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"guided_grammar": 'root ::= "<" [a-z] [a-z]? [a-z]? ">"'}, lambda t: re.fullmatch("<[a-z]{1,3}>", t)),
    ]:
        text = client.completions.create(model="m", prompt="x", max_tokens=40, temperature=0.8, seed=5,
                                         extra_body=extra).choices[0].text
        assert check(text), (extra, text)
    compact_server.wait_idle()


def test_token_bitmask_kernel_and_torch_fallback_equal_a_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU kernel and the torch path (no compiler) mask exactly the tokens whose bit is 0,
    and every logit past the tokenizer's vocabulary, in the given rows only."""
    from moestream.kernels.sampling import apply_token_bitmask
    from moestream.structured_output import guidance

    gen = torch.Generator().manual_seed(0)
    vocab, V, W = 1000, 1010, 32  # 1000 tokens need 32 words (the last one partly used)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, W), dtype=torch.int32, generator=gen)
    bitmask[0, :5] = -1  # whole words allowed
    bitmask[1, 5:9] = 0  # whole words forbidden
    rows = [4, 0, 2]
    logits = torch.randn(5, V, generator=gen)
    expected = logits.clone()
    for i, r in enumerate(rows):
        for t in range(V):
            if t >= vocab or not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    got = logits.clone()
    apply_token_bitmask(got, bitmask, torch.tensor(rows), vocab)
    assert torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="row 5 outside"):
        apply_token_bitmask(got, bitmask, torch.tensor([0, 1, 5]), vocab)

    class Fixed:  # a matcher whose mask is this bitmask row (llguidance's fill, bypassed)
        def __init__(self, i: int) -> None:
            self.i = i

    fills = []

    def fill_par(executor: object, pairs: list, out: torch.Tensor) -> None:
        fills.append(len(pairs))
        for m, j in pairs:
            out[j] = bitmask[m.i]

    def fill_one(m: Fixed, out: torch.Tensor, j: int) -> None:  # the prefetch thread's, row by row
        fills.append(1)
        out[j] = bitmask[m.i]

    matchers = []
    for i in range(3):
        m = guidance.GuidanceMatcher.__new__(guidance.GuidanceMatcher)
        m._llg = type("llg", (), {"torch": type("t", (), {"allocate_token_bitmask": staticmethod(
            lambda n, v: torch.zeros(n, (v + 31) // 32, dtype=torch.int32)),
            "fill_next_token_bitmask_par": staticmethod(fill_par),
            "fill_next_token_bitmask": staticmethod(fill_one)})})
        m._tokenizer_vocab, m._executor, m._matcher, m._pending, m._version = vocab, None, Fixed(i), None, 0
        matchers.append(m)
    for kernels in (True, False):
        monkeypatch.setattr(guidance, "load_cpu_kernels", lambda k=kernels: k)
        got = logits.clone()
        guidance.GuidanceMatcher.mask_rows(matchers, got, rows)
        assert torch.equal(got, expected), f"kernels={kernels}"
    # masks prefetched during the forward pass (in another order) are used, not computed again
    backend = guidance.GuidanceBackend.__new__(guidance.GuidanceBackend)
    backend._llg, backend._executor, backend._prefetch_pool = matchers[0]._llg, None, None
    backend._tokenizer = type("tok", (), {"vocab_size": vocab})
    fills.clear()
    backend.prefetch(matchers[::-1])
    got = logits.clone()
    guidance.GuidanceMatcher.mask_rows(matchers, got, rows)
    assert torch.equal(got, expected) and fills == [1, 1, 1]
    backend.prefetch(matchers)
    matchers[1]._version += 1  # a matcher that moved since: its mask is computed again, with the others'
    got = logits.clone()
    guidance.GuidanceMatcher.mask_rows(matchers, got, rows)
    assert torch.equal(got, expected) and fills == [1, 1, 1, 1, 1, 1, 3]


# ---- speculative decoding --------------------------------------------------------------------


def test_constrained_outputs_with_ngram_speculation_equal_speculation_off() -> None:
    params = [SamplingParams(temperature=0, max_tokens=64, structured_outputs=SO(json=SCHEMA,
                                                                                  disable_any_whitespace=True)),
              SamplingParams(temperature=0, max_tokens=24, structured_outputs=SO(regex=r"(ab|cd){1,12}")),
              SamplingParams(temperature=0, max_tokens=24)]
    prompts = ["def parse(path):", "x = 'abab", "import os\nimport os\nimport"]
    off = [o.outputs[0].text for o in LLM(demo_model_path(), dtype="float32", max_model_len=256).generate(
        prompts, params)]
    spec = LLM(demo_model_path(), dtype="float32", max_model_len=256,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    assert [o.outputs[0].text for o in spec.generate(prompts, params)] == off
    assert spec.spec_decode_stats()["num_accepted_tokens"] > 0


@pytest.mark.parametrize("right", [0, 2])
def test_drafts_the_grammar_forbids_are_rejected_with_exact_counts(right: int) -> None:
    """A test drafter proposes the constrained greedy output's next `right` tokens, then a
    token the regex forbids (a letter where only digits may come). The output is unchanged,
    and each drafted step accepts exactly min(right, its drafts)."""
    from scripted_proposer import ScriptedProposer

    k, max_tokens = 3, 12
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            structured_outputs=SO(regex=r"[0-9]{40}"))
    base = LLM(demo_model_path(), dtype="float32", max_model_len=256)
    prompt = base.get_tokenizer().encode("n = ")
    ref = base.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    letter = base.get_tokenizer().encode("x")[0]

    class ForbiddenDrafts(ScriptedProposer):
        def propose(self, token_ids: list[int], k: int) -> list[int]:
            right_part = super().propose(token_ids, k)[: self.right(0, len(token_ids) - len(prompt))]
            return (right_part + [letter] * k)[:k]

    llm = LLM(demo_model_path(), dtype="float32", max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": k, "adaptive": False})
    drafter = ForbiddenDrafts([(prompt, ref)], lambda i, n: right, llm.llm_engine.model_config.vocab_size)
    llm.llm_engine.proposer = drafter
    out = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    assert out.token_ids == ref and re.fullmatch("[0-9]+", out.text)
    stats = llm.spec_decode_stats()
    assert (stats["num_drafts"], stats["num_accepted_tokens"]) == drafter.expected(0, max_tokens, k)


def test_a_slow_compile_is_a_400_and_finishes_in_the_background(compact_server, monkeypatch) -> None:
    """A grammar that does not compile within compile_timeout is refused (400 naming the
    field) while the server goes on serving; the compile finishes in the background and caches,
    so the same request then works. (The compile is held on an event: a real compile of a small
    regex can beat any timeout, which made this test flaky.)"""
    import threading

    from moestream import EngineConfig

    with pytest.raises(ValueError, match=r"compile_timeout \(seconds > 0\)"):
        EngineConfig(model=demo_model_path(), structured_outputs_config={"compile_timeout": 0})
    body = {"prompt": "x", "max_tokens": 8, "temperature": 0, "structured_outputs": {"regex": "[a-f]{2}-[0-9]{5}"}}
    engine = compact_server.async_engine
    backend = engine.engine.grammar_backend
    release, finished = threading.Event(), threading.Event()
    real_compile = backend.compile

    def held_compile(params):
        release.wait(30)
        try:
            return real_compile(params)
        finally:
            finished.set()

    monkeypatch.setattr(backend, "compile", held_compile)
    engine.compile_timeout = 0.05
    try:
        r = compact_server.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"
        assert "did not compile within 0.05 s" in r.json()["error"]["message"]
        assert compact_server.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
        release.set()
        assert finished.wait(30)
    finally:
        release.set()
        engine.compile_timeout = 10.0
    monkeypatch.undo()
    r = compact_server.post("/v1/completions", json=body)
    assert r.status_code == 200 and re.fullmatch("[a-f]{2}-[0-9]{5}", r.json()["choices"][0]["text"])
