"""The built-in demo models, shipped as package data so that moestream runs offline with no
model path. Both are trained on the Python standard library by `scripts/train_demo_model.py`:

- `demo` (`moestream/demo_model/`, the default): a ~10M-parameter Qwen3-MoE (6 layers,
  16 experts, top-2);
- `demo-hybrid` (`moestream/demo_hybrid_model/`, `--arch qwen3_5_moe`): a ~11M-parameter
  Qwen3.5-MoE (Gated DeltaNet and gated attention 3:1, 16 experts top-2 and a shared
  expert) with one MTP layer for speculative decoding;
- `demo-looped` (`moestream/demo_looped_model/`, `scripts/train_demo_looped.py`): a
  ~11M-parameter looped MoE (`loop-moe`, Foil-style: one head layer, a stack of 2 layers run
  4 times with per-pass attention, 16 experts top-2, one tail layer).

A model argument that names one of them (and is not an existing directory) means it.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from importlib import resources

BUILTIN_MODELS = {"demo": "demo_model", "demo-hybrid": "demo_hybrid_model", "demo-looped": "demo_looped_model"}


def builtin_model_path(name: str) -> str:
    """Directory of the packaged checkpoint `name` ("demo", "demo-hybrid" or "demo-looped").

    Raises:
        ValueError: `name` is not a built-in model, or the package was installed without it.
    """
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; built-in: {', '.join(BUILTIN_MODELS)}")
    path = str(resources.files("moestream") / BUILTIN_MODELS[name])
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(
            f"the built-in model {name!r} is missing from {path}; reinstall moestream, or give a checkpoint "
            "directory as the model"
        )
    return path


def demo_model_path() -> str:
    """Directory of the default demo checkpoint (`builtin_model_path("demo")`)."""
    return builtin_model_path("demo")


def demo_hybrid_model_path() -> str:
    """Directory of the hybrid demo checkpoint (`builtin_model_path("demo-hybrid")`)."""
    return builtin_model_path("demo-hybrid")


def resolve_model(model: str | os.PathLike) -> str | os.PathLike:
    """`model` itself, or the built-in checkpoint's directory when `model` is a built-in name
    ("demo", "demo-hybrid", "demo-looped") and no directory of that name exists here."""
    if isinstance(model, str) and model in BUILTIN_MODELS and not os.path.isdir(model):
        return builtin_model_path(model)
    return model


def is_heldout(path: str, base: str) -> bool:
    """The demos' train / held-out split: a standard-library file is held out when the SHA-256
    of its path relative to `base` is 0 mod 20 (5% of the files)."""
    return int(hashlib.sha256(os.path.relpath(path, base).encode()).hexdigest(), 16) % 20 == 0


def _stdlib_files() -> tuple[str, list[str]]:
    """(the standard library's directory, its .py files outside site-packages, sorted)."""
    base = sysconfig.get_paths()["stdlib"]
    out = []
    for root, dirs, files in os.walk(base):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__"))
        out += [os.path.join(root, f) for f in sorted(files) if f.endswith(".py")]
    return base, out


def heldout_files() -> list[str]:
    """The standard library's held-out .py files (no site-packages), sorted: the text the
    demos never saw in training, and `moestream eval-loss`'s default."""
    base, files = _stdlib_files()
    return [f for f in files if is_heldout(f, base)]


def training_files() -> list[str]:
    """The rest of the standard library's .py files, sorted: the demos' training split, and
    `moestream calibrate`'s default text (so that calibration never sees held-out text)."""
    base, files = _stdlib_files()
    return [f for f in files if not is_heldout(f, base)]
