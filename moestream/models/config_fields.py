"""Typed reads of an HF config dict (`HFConfigFields`), shared by the model files."""

from __future__ import annotations

from typing import Any

from moestream.validation import is_int, is_number

REQUIRED: Any = object()  # `default` of a field that must be present


class HFConfigFields:
    """Typed reads of an HF config dict: the one place its values are checked.

    Every error is a ValueError naming `where` (the config.json path) and the field:
    `names[key]` when given (a key taken from elsewhere in the file), else `prefix` + key.
    """

    def __init__(self, hf: dict[str, Any], where: str, model_name: str, prefix: str = "",
                 names: dict[str, str] | None = None) -> None:
        self.hf, self.where, self.model_name, self.prefix, self.names = hf, where, model_name, prefix, names or {}

    def name(self, key: str) -> str:
        """How errors name field `key`."""
        return self.names.get(key, self.prefix + key)

    def error(self, key: str, problem: str) -> ValueError:
        """The error for field `key`: '<where>: field '<name>' <problem>'."""
        return ValueError(f"{self.where}: field '{self.name(key)}' {problem}")

    def get(self, key: str, kind: type | tuple[type, ...], *alternatives: str, default: Any = REQUIRED) -> Any:
        """The value of the first of `key`, `*alternatives` that is set (not missing or null),
        checked to be of `kind`; `default` when none is set.

        Raises:
            ValueError: none is set and there is no default, or the value is not of `kind`.
        """
        for k in (key, *alternatives):
            value = self.hf.get(k)
            if value is None:
                continue
            kinds = kind if isinstance(kind, tuple) else (kind,)
            if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
                names = _KIND_NAMES.get(kind) or " or ".join(_KIND_NAMES.get(t, t.__name__) for t in kinds)
                raise self.error(k, f"must be {names}, got {type(value).__name__} {value!r}")
            return value
        if default is not REQUIRED:
            return default
        also = "".join(f" (or '{self.name(a)}')" for a in alternatives)
        state = "null" if key in self.hf else "missing"
        needed = f"a {self.model_name} config needs it"
        raise ValueError(f"{self.where}: field '{self.name(key)}'{also} is {state}; {needed}")

    def integer(self, key: str, *alternatives: str, default: Any = REQUIRED, minimum: int | None = None) -> Any:
        """An integer field (not a bool), at least `minimum` when given. See `get`."""
        value = self.get(key, int, *alternatives, default=default)
        if minimum is not None and is_int(value) and value < minimum:
            used = next(k for k in (key, *alternatives) if self.hf.get(k) is not None)
            raise self.error(used, f"must be at least {minimum}, got {value}")
        return value

    def number(self, key: str, default: Any = REQUIRED) -> Any:
        """A finite number (int or float, not a bool), as a float. See `get`."""
        value = self.get(key, (int, float), default=default)
        if is_number(value) or value is None:
            return value if value is None else float(value)
        raise self.error(key, f"must be a finite number, got {value!r}")

    def flag(self, key: str, default: bool) -> bool:
        """A JSON true/false field. See `get`."""
        return self.get(key, bool, default=default)

    def integers(self, key: str, default: Any = REQUIRED) -> Any:
        """A list of integers, as a tuple. See `get`."""
        value = self.get(key, list, default=default)
        if not isinstance(value, list):
            return value
        if not all(is_int(v) for v in value):
            raise self.error(key, f"must be a list of integers, got {value!r}")
        return tuple(value)


_KIND_NAMES: dict[type | tuple[type, ...], str] = {
    int: "an integer", (int, float): "a number", (int, list): "an integer or a list of integers",
    bool: "true or false", str: "a string", list: "a list", dict: "an object",
}


def sparse_layers(f: HFConfigFields, num_layers: int, num_experts: int) -> tuple[bool, ...]:
    """Which layers are MoE, from `decoder_sparse_step` and `mlp_only_layers` (Qwen3-MoE, Qwen3-Next)."""
    step = f.integer("decoder_sparse_step", default=1, minimum=1)
    mlp_only = set(f.integers("mlp_only_layers", default=()))
    return tuple((i not in mlp_only) and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))


def rope_fields(f: HFConfigFields) -> HFConfigFields:
    """HF's v5 `rope_parameters` overlaid with v4 `rope_scaling`, as one `HFConfigFields`."""
    params = f.get("rope_parameters", dict, default={})
    scaling = f.get("rope_scaling", dict, default={})
    names = {k: f"{f.name('rope_scaling')}.{k}" for k in scaling}
    return HFConfigFields({**params, **scaling}, f.where, f.model_name, f.name("rope_parameters") + ".", names)
