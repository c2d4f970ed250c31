import pytest

from moestream.sampling_params import Logprob, SamplingParams


def test_defaults_match_vllm() -> None:
    sp = SamplingParams()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (1.0, 1.0, 0, 0.0)
    assert sp.max_tokens == 16 and sp.seed is None and sp.logprobs is None
    assert sp.stop == [] and sp.stop_token_ids == []
    assert sp.skip_special_tokens and not sp.ignore_eos and not sp.include_stop_str_in_output
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.0, 0.0, 0.0)
    assert not sp.greedy


def test_normalises_stop_and_stop_token_ids() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


@pytest.mark.parametrize("temperature,greedy", [(0.0, True), (5e-6, True), (1e-5, False), (0.7, False)])
def test_greedy(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).greedy is greedy


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.2),
    ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.1), ("min_p", 1.1),
    ("max_tokens", 0), ("max_tokens", -3),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("presence_penalty", 2.1), ("presence_penalty", -2.1),
    ("frequency_penalty", 2.5), ("frequency_penalty", -2.5),
    ("logprobs", -1),
    ("seed", 1.5), ("seed", "7"),
    ("stop", ""), ("stop", ["ok", ""]),
])
def test_validation_errors_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field) as err:
        SamplingParams(**{field: value})
    assert "got" in str(err.value)


def test_max_tokens_message() -> None:
    with pytest.raises(ValueError, match=r"max_tokens must be .*at least 1, got 0"):
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.0), dict(top_p=1.0), dict(top_p=0.01), dict(top_k=-1), dict(top_k=1),
    dict(min_p=0.0), dict(min_p=1.0), dict(max_tokens=None), dict(max_tokens=1),
    dict(presence_penalty=-2.0), dict(frequency_penalty=2.0), dict(logprobs=0), dict(seed=0),
    dict(repetition_penalty=0.5), dict(stop=["x"]),
])
def test_boundary_values_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_logprob_is_frozen() -> None:
    lp = Logprob(logprob=-0.5, rank=1)
    assert lp.decoded_token is None
    with pytest.raises(AttributeError):
        lp.rank = 2  # type: ignore[misc]
