from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from moestream.engine.detokenizer import IncrementalDetokenizer, find_stop_string

FIXTURES = Path(__file__).parent / "fixtures" / "tokenizers"
NAMES = ["qwen2", "mistral_v1"]
TEXTS = [
    "Hello world, 你好世界! 🎉🚀 café naïve — done.",
    "def fib(n):\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)\n",
    "日本語のテキストです。東京は晴れ。",
    "  leading spaces, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and 👨‍👩‍👧 family ǅ",
]


@cache
def load(name: str) -> Any:
    return AutoTokenizer.from_pretrained(str(FIXTURES / name))


@pytest.fixture(scope="module", params=NAMES)
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return load(request.param)


def stream(tokenizer: Any, prompt: list[int], ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add_token(t) for t in ids]
    assert detok.output_text == "".join(deltas)
    assert detok.output_token_ids == ids
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_match_decode_empty_prompt(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(tokenizer, [], ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_continue_prompt(tokenizer: Any, text: str) -> None:
    """With a prompt, the output is the continuation text, SentencePiece leading spaces included."""
    ids = tokenizer.encode("Prompt: " + text, add_special_tokens=True)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    for k in range(2, len(ids) - 1):
        head = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if head.endswith("\ufffd") or not full.startswith(head):
            continue
        deltas = stream(tokenizer, ids[:k], ids[k:])
        assert not any("\ufffd" in d for d in deltas)
        assert "".join(deltas) == full[len(head):], k


def test_sentencepiece_leading_space_kept_after_prompt() -> None:
    tok = load("mistral_v1")
    ids = [tok.bos_token_id] + tok.encode("Hello world again", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "▁Hello", "▁world", "▁again"]
    assert stream(tok, ids[:2], ids[2:]) == [" world", " again"]
    assert stream(tok, ids[:1], ids[1:]) == ["Hello", " world", " again"]  # only <s>: skipped, no context
    assert stream(tok, [], ids[2:]) == ["world", " again"]  # no context: stripped like decode()


def test_multibyte_char_is_held_until_complete() -> None:
    tok = load("qwen2")
    ids = tok.encode("ok 🎉", add_special_tokens=False)
    assert len(ids) > 2  # the emoji spans several byte-level tokens
    deltas = stream(tok, [], ids)
    assert deltas[0] == "ok"
    assert deltas[1:-1] == [""] * (len(ids) - 2)
    assert deltas[-1] == " 🎉"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(skip: bool) -> None:
    tok = load("qwen2")
    ids = tok.encode("Hi there", add_special_tokens=False) + [tok.eos_token_id]
    text = "".join(stream(tok, [], ids, skip_special_tokens=skip))
    assert text == tok.decode(ids, skip_special_tokens=skip)
    assert text == ("Hi there" if skip else "Hi there<|endoftext|>")


PIECES = st.one_of(
    st.sampled_from(list("abc xyz  \n\t.,!?éïß你好世界日本語한국어🎉🚀👍") + ["\u200d", " def", "▁"]),
    st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="\ufffd"),
)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.lists(PIECES, max_size=40).map("".join), split=st.floats(0.0, 1.0))
def test_property_random_text(tokenizer: Any, text: str, split: float) -> None:
    """Any text, split at any clean token boundary into prompt and output, streams to its decode."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    k = int(split * len(ids))
    head = tokenizer.decode(ids[:k], skip_special_tokens=True)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assume(not head.endswith("\ufffd") and full.startswith(head))
    deltas = stream(tokenizer, ids[:k], ids[k:])
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == full[len(head):]
    if k == 0:
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


def test_find_stop_string_spanning_two_deltas() -> None:
    text = "Hello wor"
    assert find_stop_string(text, len(text), ["world"], False) is None
    text += "ld! more"
    assert find_stop_string(text, 8, ["world"], False) == ("world", 6)
    assert find_stop_string(text, 8, ["world"], True) == ("world", 11)
    assert text[:6] == "Hello " and text[:11] == "Hello world"


def test_find_stop_string_no_match_and_old_match_ignored() -> None:
    assert find_stop_string("abc def", 3, ["xyz"], False) is None
    assert find_stop_string("stop here and more", 4, ["stop"], False) is None  # matched before this delta
    assert find_stop_string("abc", 0, ["c"], False) is None
    assert find_stop_string("abc", 1, [], False) is None


def test_find_stop_string_earliest_match_wins() -> None:
    assert find_stop_string("say hello world", 11, ["world", "lo"], False) == ("lo", 7)
    assert find_stop_string("xx</s>", 6, ["</s>", "</"], True) == ("</s>", 6)


def test_stop_string_with_detokenizer_stream() -> None:
    tok = load("qwen2")
    ids = tok.encode("The answer is 42.\n\nUser: next", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    hit = None
    for t in ids:
        delta = detok.add_token(t)
        hit = find_stop_string(detok.output_text, len(delta), ["\n\nUser:"], False)
        if hit:
            break
    assert hit is not None
    assert detok.output_text[:hit[1]] == "The answer is 42."
