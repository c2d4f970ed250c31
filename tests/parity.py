"""Comparison of engine output with HF's, with numerical ties counted, never hidden."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from moestream import SamplingParams

TIE_GAP = 1e-5
LOGITS_ATOL = 1e-4


class HFReferenceLike(Protocol):
    def generate(self, prompt: list[int]) -> tuple[list[int], torch.Tensor]: ...


class LogitsRecorder:
    """A vLLM-style logits processor that records the raw logits [V] at each sampled position."""

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] = []

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        self.logits.append(logits.detach().clone())
        return logits


def greedy_params(recorder: LogitsRecorder, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logits_processors=[recorder])


@dataclass
class ParityReport:
    ties: list[str] = field(default_factory=list)
    max_logit_diff: float = 0.0


def check_parity(
    ours: list[int], our_logits: list[torch.Tensor], ref: list[int], ref_logits: torch.Tensor, report: ParityReport, name: str
) -> None:
    """Assert token equality (allowing only a true numerical tie at the first divergence) and
    logits within LOGITS_ATOL up to the divergence."""
    assert len(our_logits) == len(ours), f"{name}: {len(our_logits)} logits recorded for {len(ours)} tokens"
    n = min(len(ours), len(ref))
    diverge = next((i for i in range(n) if ours[i] != ref[i]), None)
    upto = n if diverge is None else diverge + 1
    for i in range(upto):
        diff = (our_logits[i] - ref_logits[i]).abs().max().item()
        report.max_logit_diff = max(report.max_logit_diff, diff)
        assert diff < LOGITS_ATOL, f"{name}: logits at output position {i} differ by {diff:.3g}"
    if diverge is None:
        assert len(ours) == len(ref), f"{name}: {len(ours)} tokens, HF gave {len(ref)}"
        return
    top2 = ref_logits[diverge].topk(2).values
    gap = (top2[0] - top2[1]).item()
    assert gap < TIE_GAP, (
        f"{name}: token {diverge} is {ours[diverge]}, HF gives {ref[diverge]} (top-2 gap {gap:.3g}: not a tie)"
    )
    report.ties.append(f"{name}: tie at position {diverge} (gap {gap:.2g})")
    print("numerical tie:", report.ties[-1])


def check_all(prompts: list[list[int]], results: list, reference: "HFReferenceLike", label: str) -> ParityReport:
    """check_parity for each (prompt, (tokens, LogitsRecorder)) against `reference.generate(prompt)`;
    prints the largest logit difference and the number of ties."""
    report = ParityReport()
    for i, (prompt, (tokens, rec)) in enumerate(zip(prompts, results)):
        ref_tokens, ref_logits = reference.generate(prompt)
        check_parity(tokens, rec.logits, ref_tokens, ref_logits, report, f"{label} prompt {i} (len {len(prompt)})")
    print(f"{label}: max logit diff {report.max_logit_diff:.2e}, ties {len(report.ties)}")
    return report
