"""How well a cartridge stands in for its document: the loss of texts after it.

`text_loss` scores texts through the engine's prompt logprobs (teacher-forced, exact), after
nothing, after a literal prefix (the whole document in context) or after cartridges. Each
text's first token is not scored (after a cartridge no logit predicts it), so the three
settings score the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from moestream.llm import LLM
from moestream.sampling_params import SamplingParams


def text_loss(llm: LLM, texts: Sequence[Sequence[int]], prefix: Sequence[int] = (),
              cartridges: Sequence[str | dict] | None = None, routing: str | None = None) -> float:
    """Mean negative log-likelihood (nats per token) of `texts`' tokens after the first, each
    text after `prefix` token ids and/or `cartridges` (routed per text with `routing`
    "auto", attached to every text with "always", by default the engine's).

    Raises:
        ValueError: no text of two or more tokens, or a prompt the engine refuses.
    """
    texts = [list(t) for t in texts if len(t) >= 2]
    if not texts:
        raise ValueError("text_loss needs texts of at least 2 tokens")
    prompts = [{"prompt_token_ids": list(prefix) + t, **({"cartridge_routing": routing} if routing else {})}
               for t in texts]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0),
                        cartridges=cartridges)
    total, count = 0.0, 0
    for out, text in zip(outs, texts):
        entries = out.prompt_logprobs[len(prefix) + 1:]
        for token, entry in zip(text[1:], entries):
            total -= entry[token].logprob
            count += 1
    return total / count
