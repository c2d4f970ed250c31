"""`StructuredOutputsParams`: what a request's output must match, named as vLLM's
(vllm/sampling_params.py `StructuredOutputsParams`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint:

    - `json`: a JSON schema (dict or JSON text);
    - `regex`: a regular expression the whole output matches;
    - `choice`: a list of strings, the output is one of them;
    - `grammar`: a Lark grammar, or GBNF (llama.cpp's EBNF: `root ::= ...`);
    - `json_object`: True, any JSON object;
    - `structural_tag`: vLLM's structural tag, as JSON text or a dict:
      `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`. Free text, in which
      each structure starts when the model writes its `begin` (which starts with one of the
      `triggers`); its arguments then follow `schema` (JSON schema) and `end` closes it.
      The tool-call pattern of llguidance's `StructTag` (its docs/syntax.md, "Tool calling").

    `disable_any_whitespace`: JSON without whitespace between tokens (compact), as vLLM's
    option; a small model under a grammar that allows any whitespace can emit newlines until
    max_tokens runs out. `whitespace_pattern`: a regex for the whitespace JSON may hold
    between tokens (vLLM's option; llguidance's `whitespace_pattern`), e.g. `[ ]?`.

    Raises:
        ValueError: none or several constraints, or a value of the wrong type; the message
            names the field.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

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
        if self.structural_tag is not None:
            self._check_structural_tag()
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError(f"structured_outputs.whitespace_pattern must be a string, got {self.whitespace_pattern!r:.80}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be true or false")

    def structural_tag_spec(self) -> dict[str, Any]:
        """`structural_tag` as a dict (parsed when given as JSON text)."""
        tag = self.structural_tag
        return json.loads(tag) if isinstance(tag, str) else tag

    def _check_structural_tag(self) -> None:
        """Raises ValueError, naming the field, unless `structural_tag` has non-empty
        `structures` (each with string `begin` and `end` and a `schema`) and `triggers`
        (strings), and every `begin` starts with a trigger."""
        field = "structured_outputs.structural_tag"
        if not isinstance(self.structural_tag, (dict, str)):
            raise ValueError(f"{field} must be an object or JSON text, got {self.structural_tag!r:.80}")
        try:
            tag = self.structural_tag_spec()
        except ValueError as e:
            raise ValueError(f"{field} is not valid JSON: {e}") from None
        structures, triggers = (tag.get("structures"), tag.get("triggers")) if isinstance(tag, dict) else (None, None)
        if not (isinstance(triggers, list) and triggers and all(isinstance(t, str) and t for t in triggers)):
            raise ValueError(f"{field}.triggers must be a non-empty list of non-empty strings")
        if not (isinstance(structures, list) and structures):
            raise ValueError(f"{field}.structures must be a non-empty list of {{begin, schema, end}}")
        for i, st in enumerate(structures):
            if not (isinstance(st, dict) and isinstance(st.get("begin"), str) and isinstance(st.get("end"), str)
                    and isinstance(st.get("schema"), (dict, bool))):
                raise ValueError(f"{field}.structures[{i}] needs begin and end (strings) and schema (a JSON schema)")
            if not any(st["begin"].startswith(t) for t in triggers):
                raise ValueError(f"{field}.structures[{i}].begin {st['begin']!r} starts with none of the triggers "
                                 f"{triggers}")

    @property
    def kind(self) -> str:
        """Which constraint: one of KINDS."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> str:
        """The compiled-grammar cache key: the constraint and its options, as canonical JSON."""
        value = getattr(self, self.kind)
        if self.kind in ("json", "structural_tag") and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                pass  # refused when compiled, with the parser's message
        return json.dumps([self.kind, value, self.disable_any_whitespace, self.whitespace_pattern], sort_keys=True)
