"""The built-in demo model: a ~10M-parameter Qwen3-MoE (6 layers, 16 experts, top-2)
trained on the Python standard library by `scripts/train_demo_model.py`, shipped as
package data so that `moestream generate` runs offline with no model path."""

from __future__ import annotations

import os
from importlib import resources


def demo_model_path() -> str:
    """Directory of the packaged demo checkpoint.

    Raises:
        ValueError: the package was installed without its demo model.
    """
    path = str(resources.files("moestream") / "demo_model")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(
            f"the built-in demo model is missing from {path}; reinstall moestream, or give a checkpoint directory "
            "as the model"
        )
    return path
