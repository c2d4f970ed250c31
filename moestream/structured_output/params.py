"""`StructuredOutputsParams`: what a request's output must match, named as vLLM's
(vllm/sampling_params.py `StructuredOutputsParams`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint:

    - `json`: a JSON schema (dict or JSON text);
    - `regex`: a regular expression the whole output matches;
    - `choice`: a list of strings, the output is one of them;
    - `grammar`: a Lark grammar, or GBNF (llama.cpp's EBNF: `root ::= ...`);
    - `json_object`: True, any JSON object.

    `disable_any_whitespace`: JSON without whitespace between tokens (compact), as vLLM's
    option; a small model under a grammar that allows any whitespace can emit newlines until
    max_tokens runs out.

    Raises:
        ValueError: none or several constraints, or a value of the wrong type; the message
            names the field.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (object or text), got {self.json!r:.80}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"structured_outputs.regex must be a string, got {self.regex!r:.80}")
        if self.choice is not None and not (isinstance(self.choice, (list, tuple)) and self.choice
                                            and all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r:.80}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError(f"structured_outputs.grammar must be a string, got {self.grammar!r:.80}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be true or false")

    @property
    def kind(self) -> str:
        """Which constraint: one of KINDS."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> str:
        """The compiled-grammar cache key: the constraint and its options, as canonical JSON."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                pass  # refused when compiled, with the parser's message
        return json.dumps([self.kind, value, self.disable_any_whitespace], sort_keys=True)
