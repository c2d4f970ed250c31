"""Engine options, read from their one declaration (`EngineConfig`'s fields, `option`):
the command line's flags (`add_engine_args`, `engine_kwargs`), `LLM(model, **kw)`'s keyword
filter (`engine_config`) and the checks of names that live with their component
(`check_engine_config`). nano-vllm's `Config` fields and mini-sglang's `server/args.py` are
the model.

Imports no torch, so that `moestream --help` answers at once.
"""

from __future__ import annotations

import argparse
import difflib
from dataclasses import MISSING, Field, fields
from typing import Any

from moestream.config.engine import EngineConfig
from moestream.experts.policy import POLICY_NAMES

# Choices that are names of a component's implementations, declared with the component.
_COMPONENT_CHOICES: dict[str, tuple[str, ...]] = {"expert_policy": POLICY_NAMES}


def engine_options() -> tuple[Field, ...]:
    """The declared engine options, in declaration order."""
    return fields(EngineConfig)


def flag_name(name: str) -> str:
    """'max_model_len' -> '--max-model-len'."""
    return "--" + name.replace("_", "-")


def _default_text(f: Field) -> str:
    """How the help states `f`'s default."""
    meta = f.metadata
    if meta.get("default_help") is not None:
        return meta["default_help"]
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    return str(f.default)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per engine option to `parser`, in argument groups by the option's
    `group`: `--max-model-len N`; bools as `--flag` / `--no-flag`. Every default is None
    on the parser, so that `engine_kwargs` passes only the flags given and `EngineConfig`
    keeps the one default."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in engine_options():
        meta = f.metadata
        if not meta["flag"]:
            continue
        group = groups.get(meta["group"])
        if group is None:
            group = groups[meta["group"]] = parser.add_argument_group(meta["group"])
        kw: dict[str, Any] = dict(default=None, help=f"{meta['help']} (default: {_default_text(f)})")
        if isinstance(f.default, bool):
            kw["action"] = argparse.BooleanOptionalAction
        else:
            if meta["parse"] is not None:
                kw["type"] = meta["parse"]
            choices = meta["choices"] or _COMPONENT_CHOICES.get(f.name)
            if choices:
                kw["choices"] = list(choices)
            if meta["metavar"]:
                kw["metavar"] = meta["metavar"]
        group.add_argument(flag_name(f.name), dest=f.name, **kw)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`EngineConfig` keyword arguments from the flags parsed by `add_engine_args`: the
    flags given, and `model` ('demo' when no model was given)."""
    kw = {f.name: getattr(args, f.name) for f in engine_options()
          if f.metadata["flag"] and getattr(args, f.name, None) is not None}
    kw.setdefault("model", "demo")
    return kw


def engine_config(model: str, **kwargs: Any) -> EngineConfig:
    """`EngineConfig(model, **kwargs)`, checked (`check_engine_config`): `LLM(model, **kw)`'s
    filter.

    Raises:
        TypeError: a keyword that is not an engine option (the message suggests the closest).
        ValueError: a bad value (the message names the option).
    """
    known = {f.name for f in engine_options()}
    unknown = [k for k in kwargs if k not in known]
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(k, known, n=1)
            hints.append(f"'{k}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
        raise TypeError(f"unknown engine argument{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; the engine "
                        f"options are: {', '.join(sorted(known))}")
    config = EngineConfig(model=model, **kwargs)
    check_engine_config(config)
    return config


def check_engine_config(config: EngineConfig) -> None:
    """Checks of the options whose valid values live with a component (the eviction
    policies' names with the policies).

    Raises:
        ValueError: an unknown name; the message lists the valid ones.
    """
    for name, valid in _COMPONENT_CHOICES.items():
        value = getattr(config, name)
        if value not in valid:
            raise ValueError(f"unknown {name.replace('_', ' ')} '{value}'; use one of {', '.join(valid)}")


def option_default(name: str) -> Any:
    """The declared default of engine option `name`.

    Raises:
        KeyError: not an engine option, or one without a default.
    """
    for f in engine_options():
        if f.name == name and f.default is not MISSING:
            return f.default
    raise KeyError(name)
