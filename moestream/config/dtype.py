"""User dtype names -> torch dtypes."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# user name -> torch attribute (torch is imported on first use, so that the command line's
# parser, built from this package, does not import it)
_DTYPES: dict[str, str] = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}


def resolve_dtype(dtype: str | torch.dtype, config_dtype: str | None) -> torch.dtype:
    """Map a user dtype ("float32", "bfloat16", "float16" or "auto") to a torch dtype.

    "auto" takes the checkpoint's `torch_dtype`, and float32 when it has none.

    Raises:
        ValueError: an unknown dtype name.
    """
    import torch

    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16, float16 or auto")
        return dtype
    if dtype == "auto":
        return getattr(torch, _DTYPES.get(str(config_dtype), "float32"))
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype '{dtype}'; use float32, bfloat16, float16 or auto")
    return getattr(torch, _DTYPES[dtype])
