import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moestream.sampler import (
    Sampler,
    SamplerOutput,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    make_generator,
)
from moestream.sampling_params import SamplingParams

NEG_INF = float("-inf")


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


def log_probs(*probs: float) -> list[float]:
    return [math.log(p) for p in probs]


def test_top_k_keeps_k_largest_with_lower_id_on_ties() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 5.0, 2.0]] * 4)
    out = apply_top_k(logits, torch.tensor([2, 1, 3, 0]))
    assert kept(out[0]) == {1, 3}
    assert kept(out[1]) == {1}  # tie between ids 1 and 3: the lower id survives
    assert kept(out[2]) == {1, 2, 3}
    assert kept(out[3]) == {0, 1, 2, 3, 4}  # 0 = disabled
    assert torch.equal(out[0, [1, 3]], torch.tensor([5.0, 5.0]))
    assert torch.equal(logits[0], torch.tensor([1.0, 5.0, 3.0, 5.0, 2.0]))  # input untouched


def test_top_k_larger_than_vocab_is_noop() -> None:
    logits = torch.tensor([[0.1, 0.2, 0.3]])
    assert torch.equal(apply_top_k(logits, torch.tensor([10])), logits)


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    logits = torch.tensor([log_probs(0.1, 0.5, 0.3, 0.1)] * 5)
    out = apply_top_p(logits, torch.tensor([0.75, 0.85, 0.3, 1.0, 0.55]))
    assert kept(out[0]) == {1, 2}  # 0.5 + 0.3 >= 0.75
    assert kept(out[1]) == {0, 1, 2}  # needs a third; tie 0/3 -> lower id 0
    assert kept(out[2]) == {1}  # top-1 alone reaches 0.3
    assert kept(out[3]) == {0, 1, 2, 3}  # 1.0 = disabled
    assert kept(out[4]) == {1, 2}  # 0.5 < 0.55
    assert torch.equal(out[0, [1, 2]], logits[0, [1, 2]])


def _top_k_by_sort(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The definition: rank by a stable descending sort, keep ranks below k."""
    V = logits.shape[-1]
    k = torch.where((k <= 0) | (k > V), V, k)
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(V).expand_as(order))
    return logits.masked_fill(rank >= k[:, None], NEG_INF)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 6), st.integers(2, 40))
def test_top_k_and_candidate_top_p_equal_the_full_sort(seed: int, rows: int, vocab: int) -> None:
    """apply_top_k (topk + ties by id) equals the stable-sort definition, and top-p over the
    top-k candidates equals top-p over the whole sorted vocabulary, ties included."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 4, (rows, vocab), generator=g).float() / 2  # many ties
    k = torch.randint(1, vocab + 1, (rows,), generator=g)
    p = torch.rand(rows, generator=g).clamp_min(0.01)
    p[0] = 1.0 if rows > 1 else p[0]
    topk = apply_top_k(logits, k)
    assert torch.equal(topk, _top_k_by_sort(logits, k))
    assert torch.equal(apply_top_p(topk, p, k), apply_top_p(topk, p))


def test_top_p_always_keeps_top1() -> None:
    out = apply_top_p(torch.tensor([[0.0, 1.0, 0.5]]), torch.tensor([1e-6]))
    assert kept(out[0]) == {1}


def test_min_p_keeps_tokens_above_scaled_max() -> None:
    logits = torch.tensor([log_probs(0.1, 0.5, 0.3, 0.1)] * 4)
    out = apply_min_p(logits, torch.tensor([0.5, 0.7, 0.1, 0.0]))
    assert kept(out[0]) == {1, 2}  # threshold 0.25
    assert kept(out[1]) == {1}  # threshold 0.35
    assert kept(out[2]) == {0, 1, 2, 3}  # threshold 0.05
    assert kept(out[3]) == {0, 1, 2, 3}


def test_penalties_exact_values() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    apply_penalties(logits, [[0], [0]], [[1, 1, 3], [4]],
                    repetition=torch.tensor([2.0, 1.0]), presence=torch.tensor([0.25, 0.0]),
                    frequency=torch.tensor([0.5, 1.0]))
    # row 0: rep on {0,1,3}; freq 0.5*count on {1:2, 3:1}; presence 0.25 on {1, 3}
    assert torch.equal(logits[0], torch.tensor([1.0, -3.25, 0.5, 0.75, -2.0]))
    # row 1: only frequency 1.0 on id 4
    assert torch.equal(logits[1], torch.tensor([2.0, -1.0, 0.5, 3.0, -3.0]))


def run(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams],
        outputs: list[list[int]] | None = None, gens: list[torch.Generator | None] | None = None,
        prompts: list[list[int]] | None = None) -> SamplerOutput:
    B = len(params)
    return sampler(logits, params, prompts or [[] for _ in range(B)], outputs or [[] for _ in range(B)],
                   gens or [None] * B)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
    out = run(Sampler(), logits, [SamplingParams(temperature=0.0)] * 6)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6


def test_greedy_with_repetition_penalty_changes_choice() -> None:
    logits = torch.tensor([[3.0, 2.0, -1.0]])
    out = run(Sampler(), logits, [SamplingParams(temperature=0.0, repetition_penalty=2.0)], outputs=[[0]])
    assert out.token_ids == [1]  # 3.0 / 2 = 1.5 < 2.0


def test_presence_penalty_in_sampler_applies_to_output_only() -> None:
    logits = torch.tensor([[3.0, 2.0, -1.0]])
    sp = SamplingParams(temperature=0.0, presence_penalty=2.0)
    assert run(Sampler(), logits, [sp], outputs=[[]], prompts=[[0]]).token_ids == [0]
    assert run(Sampler(), logits, [sp], outputs=[[0]]).token_ids == [1]


def test_seeded_row_independent_of_batch() -> None:
    g = torch.Generator().manual_seed(1)
    target = torch.randn(1000, generator=g)
    others = torch.randn(3, 1000, generator=g)
    sp = SamplingParams(temperature=1.3, top_k=200, top_p=0.95, seed=1234)
    other_sp = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(seed=9)]

    def draw(position: int, other_order: list[int], steps: int = 20) -> list[int]:
        sampler = Sampler(seed=position)
        gens = [None, None, make_generator(9)]
        mine = make_generator(sp.seed)
        tokens = []
        for _ in range(steps):
            rows = [others[j] for j in other_order]
            rows.insert(position, target)
            params = [other_sp[j] for j in other_order]
            params.insert(position, sp)
            row_gens = [gens[j] for j in other_order]
            row_gens.insert(position, mine)
            out = run(sampler, torch.stack(rows), params, gens=row_gens)
            tokens.append(out.token_ids[position])
        return tokens

    first = draw(0, [0, 1, 2])
    assert draw(3, [2, 1, 0]) == first
    assert draw(1, [1]) == first
    assert len(set(first)) > 1  # genuinely random draws


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, 1000)  # uniform over 1000 tokens

    def draw(seed: int) -> list[int]:
        sampler, gen = Sampler(), make_generator(seed)
        return [run(sampler, logits, [SamplingParams(seed=seed)], gens=[gen]).token_ids[0] for _ in range(10)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_sampler_generator_is_seeded() -> None:
    logits = torch.zeros(4, 500)
    params = [SamplingParams()] * 4
    assert run(Sampler(seed=5), logits, params).token_ids == run(Sampler(seed=5), logits, params).token_ids
    assert run(Sampler(seed=5), logits, params).token_ids != run(Sampler(seed=6), logits, params).token_ids


def test_samples_respect_masks_and_frequencies() -> None:
    logits = torch.tensor([log_probs(0.05, 0.5, 0.3, 0.15)])
    sampler = Sampler(seed=0)
    n = 4000
    cases = [(SamplingParams(top_k=2), {1, 2}), (SamplingParams(top_p=0.75), {1, 2}),
             (SamplingParams(min_p=0.2), {1, 2, 3}), (SamplingParams(), {0, 1, 2, 3})]
    for sp, allowed in cases:
        draws = run(sampler, logits.expand(n, 4), [sp] * n).token_ids
        assert set(draws) == allowed
    draws = torch.tensor(run(sampler, logits.expand(n, 4), [SamplingParams()] * n).token_ids)
    freq = torch.bincount(draws, minlength=4).float() / n
    assert torch.allclose(freq, torch.tensor([0.05, 0.5, 0.3, 0.15]), atol=0.03)
    # top_k=2 renormalises over {1, 2}: 0.5/0.8 and 0.3/0.8
    draws = torch.tensor(run(sampler, logits.expand(n, 4), [SamplingParams(top_k=2)] * n).token_ids)
    freq = torch.bincount(draws, minlength=4).float() / n
    assert torch.allclose(freq, torch.tensor([0.0, 0.625, 0.375, 0.0]), atol=0.03)


def test_low_temperature_picks_argmax() -> None:
    logits = torch.tensor([[1.0, 2.0, 1.5]] * 50)
    assert run(Sampler(), logits, [SamplingParams(temperature=0.01)] * 50).token_ids == [1] * 50


def test_logprobs_are_raw_and_ranked() -> None:
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.5, repetition_penalty=1.7, top_k=5, logprobs=3), SamplingParams()]
    out = run(Sampler(), logits, params, outputs=[[0, 1, 2], [4]])
    assert out.logprobs[1] is None
    entries = out.logprobs[0]
    assert len(entries) == 4
    raw = torch.log_softmax(logits, dim=-1)[0]
    order = torch.argsort(raw, descending=True).tolist()
    sampled, lp, rank = entries[0]
    assert sampled == out.token_ids[0]
    assert lp == raw[sampled].item()
    assert rank == order.index(sampled) + 1
    assert [(t, r) for t, _, r in entries[1:]] == [(order[0], 1), (order[1], 2), (order[2], 3)]
    assert [v for _, v, _ in entries[1:]] == raw[order[:3]].tolist()


def test_logprobs_zero_returns_only_sampled() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    out = run(Sampler(), logits, [SamplingParams(temperature=0.0, logprobs=0)])
    assert out.token_ids == [2]
    expected = torch.log_softmax(logits[0], dim=-1)[2].item()
    assert out.logprobs == [[(2, expected, 1)]]


def test_logits_processors_applied_before_logprobs() -> None:
    seen: list[list[int]] = []

    def only_seven(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append(output_ids)
        mask = torch.full_like(logits, NEG_INF)
        mask[7] = 0.0
        return logits + mask

    def add_one(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        return logits + 1.0

    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(logits_processors=[add_one, only_seven], logprobs=1), SamplingParams(temperature=0.0)]
    out = run(Sampler(), logits, params, outputs=[[3, 5], []])
    assert out.token_ids == [7, int(logits[1].argmax())]
    assert seen == [[3, 5]]
    assert out.logprobs[0] == [(7, 0.0, 1), (7, 0.0, 1)]


def test_caller_logits_never_modified() -> None:
    """The sampler copies the logits only when it writes to them (penalties, logits
    processors, even one that edits its row in place); the caller's tensor keeps its values."""

    def zero_first_in_place(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[0] = 100.0
        return logits

    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(5))
    before = logits.clone()
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0),
              SamplingParams(temperature=0.0, logits_processors=[zero_first_in_place]),
              SamplingParams(temperature=0.0)]
    out = run(Sampler(), logits, params, outputs=[[int(before[0].argmax())], [], []])
    assert torch.equal(logits, before)
    assert out.token_ids[1] == 0 and out.token_ids[2] == int(before[2].argmax())
    greedy = run(Sampler(), logits, [SamplingParams(temperature=0.0)] * 3)
    assert greedy.token_ids == before.argmax(dim=-1).tolist() and torch.equal(logits, before)


def test_greedy_takes_the_first_of_tied_maxima() -> None:
    """Greedy picks what argmax picks: the lowest id among tied maxima, in every row."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [-1.0, -1.0, -1.0, -1.0], [0.0, 2.0, 5.0, 5.0]])
    out = run(Sampler(), logits, [SamplingParams(temperature=0.0)] * 3)
    assert out.token_ids == [1, 0, 2] == logits.argmax(dim=-1).tolist()


def test_logit_bias_is_added_after_raw_logprobs_and_only_to_its_row() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [2.0, 1.0, 0.0, -1.0]])
    params = [SamplingParams(temperature=0.0, logit_bias={3: 3.5, 0: -0.5}, logprobs=1),
              SamplingParams(temperature=0.0, logprobs=1)]
    out = run(Sampler(), logits, params)
    assert out.token_ids == [3, 0]  # row 0: [1.5, 1, 0, 2.5]; row 1 untouched
    raw = logits[0].log_softmax(dim=-1)
    assert math.isclose(out.logprobs[0][0][1], raw[3].item(), rel_tol=1e-6)  # the raw logprob, rank 4
    assert out.logprobs[0][0][2] == 4
    # a bias and a penalty: the bias first, then repetition_penalty divides the biased positive logit
    sp = SamplingParams(temperature=0.0, logit_bias={1: 2.0}, repetition_penalty=2.0)
    assert run(Sampler(), logits[:1], [sp], outputs=[[1]]).token_ids == [0]  # (1 + 2) / 2 = 1.5 < 2
    assert logits[0].tolist() == [2.0, 1.0, 0.0, -1.0]  # the caller's logits are not modified
