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
        assert " " not in text.replace('" ', "").split('"name"')[0]  # compact: no whitespace between tokens
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


def test_constrained_outputs_survive_preemption_and_prefix_hits() -> None:
    constrained = SamplingParams(temperature=0, max_tokens=64, structured_outputs=SO(json=SCHEMA,
                                                                                     disable_any_whitespace=True))
    prompts = [p * 3 for p in PROMPTS[:8]]
    ref = [o.outputs[0].text for o in LLM(demo_model_path(), dtype="float32", max_model_len=128,
                                          enable_prefix_caching=False).generate(prompts, constrained)]
    mc = model_config_from_hf(demo_model_path())
    block = kv_block_bytes(mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, torch.float32)
    tight = LLM(demo_model_path(), dtype="float32", max_model_len=128, kv_cache_memory_bytes=10 * block)
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
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object; got json, regex"):
        SO(json={}, regex="a")
    with pytest.raises(ValueError, match="structured_outputs must be None or a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
