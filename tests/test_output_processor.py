"""`check_stop`, the pure stop check of the update phase: each reason, and their order."""

from __future__ import annotations

from moestream import SamplingParams
from moestream.engine.output_processor import check_stop
from moestream.engine.request import Request, RequestStatus

EOS = frozenset({2})


def _req(params: SamplingParams, outputs: list[int]) -> Request:
    r = Request("r", None, [5, 6, 7], params)
    r.token_ids.extend(outputs)
    return r


def test_each_stop_reason() -> None:
    sp = SamplingParams(max_tokens=4, stop_token_ids=[9])
    assert check_stop(_req(sp, [3]), 3, EOS, 100, None) == (None, None)
    assert check_stop(_req(sp, [2]), 2, EOS, 100, None) == (RequestStatus.FINISHED_STOPPED, None)
    assert check_stop(_req(sp, [9]), 9, EOS, 100, None) == (RequestStatus.FINISHED_STOPPED, 9)
    assert check_stop(_req(sp, [3]), 3, EOS, 100, ("ab", 4)) == (RequestStatus.FINISHED_STOPPED, "ab")
    assert check_stop(_req(sp, [3, 3, 3, 3]), 3, EOS, 100, None) == (RequestStatus.FINISHED_LENGTH, None)
    assert check_stop(_req(sp, [3]), 3, EOS, 4, None) == (RequestStatus.FINISHED_LENGTH, None)  # 3 + 1 tokens


def test_ignore_eos_and_order() -> None:
    sp = SamplingParams(max_tokens=1, ignore_eos=True, stop_token_ids=[2])
    # EOS is ignored, but the same id as a stop token still stops, before the length limit.
    assert check_stop(_req(sp, [2]), 2, EOS, 100, None) == (RequestStatus.FINISHED_STOPPED, 2)
    assert check_stop(_req(SamplingParams(max_tokens=1, ignore_eos=True), [2]), 2, EOS, 100, None) == \
        (RequestStatus.FINISHED_LENGTH, None)
