"""ExFold's calibrated scalar projectors: how well one expert's output stands in for another's.

For each MoE layer and each ordered pair of experts (e, r), over the calibration tokens
routed to e (S_e, the router's top-k):

    alpha[e, r]     = sum_{x in S_e} <E_e(x), E_r(x)> / sum_{x in S_e} |E_r(x)|^2
    explained[e, r] = (sum <E_e, E_r>)^2 / (sum |E_e|^2 * sum |E_r|^2)   (in [0, 1])

alpha is the least-squares scalar with E_e(x) ~ alpha E_r(x); `explained` is the fraction
of E_e's energy on S_e that alpha E_r recovers. Folding an excluded pair (weight w on e)
onto a retained expert r adds alpha[e, r] * w to r's weight; the fold picks the retained r
of largest `explained`. When E_e = c E_r on S_e, alpha = c and the fold is exact.

This is written from ExFold's description (training-free folding of excluded experts onto
retained ones with calibrated scalar projectors); the paper's own estimator was not
available, so the least-squares scalar above is our choice (docs/expert_modes.md).

File: safetensors beside the checkpoint (`exfold_projectors.safetensors`) with tensors
`layers.{i}.alpha` and `layers.{i}.explained` [E, E] float32 per routed-expert layer i, and
metadata "format" ("moestream-exfold-projectors/1"), "num_experts", "tokens", "seed",
"text_sha256".
"""

from __future__ import annotations

import os

import numpy as np
import torch
from safetensors.torch import load_file, save_file

FORMAT = "moestream-exfold-projectors/1"
FILE_NAME = "exfold_projectors.safetensors"


class ProjectorStats:
    """Running sums over calibration tokens for one layer's E experts (float64):
    add(outputs [N, E, H], routed [N, E] bool) after each batch; `projectors()` at the end."""

    def __init__(self, num_experts: int) -> None:
        self.dot = torch.zeros(num_experts, num_experts, dtype=torch.float64)  # [e, r]: sum_{S_e} <E_e, E_r>
        self.norm = torch.zeros(num_experts, num_experts, dtype=torch.float64)  # [e, r]: sum_{S_e} |E_r|^2
        self.tokens = 0

    def add(self, outputs: torch.Tensor, routed: torch.Tensor) -> None:
        """outputs [N, E, H] (every expert's output for N tokens), routed [N, E] bool (the
        router's top-k of each token)."""
        y = outputs.to(torch.float64)
        sq = (y * y).sum(-1)  # [N, E]
        gram = torch.einsum("neh,nrh->ner", y, y)  # [N, E, E]
        m = routed.to(torch.float64)  # [N, E]
        self.dot += torch.einsum("ne,ner->er", m, gram)
        self.norm += m.T @ sq
        self.tokens += len(y)

    def projectors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(alpha [E, E], explained [E, E]) float32; a pair never seen (no token routed to e,
        or E_r zero there) has alpha 0 and explained 0."""
        own = torch.diagonal(self.dot)  # [E]: sum_{S_e} |E_e|^2
        safe = torch.where(self.norm > 0, self.norm, torch.ones_like(self.norm))
        alpha = torch.where(self.norm > 0, self.dot / safe, torch.zeros_like(self.dot))
        denom = self.norm * own[:, None]
        explained = torch.where(denom > 0, self.dot ** 2 / torch.where(denom > 0, denom, torch.ones_like(denom)),
                                torch.zeros_like(denom))
        return alpha.float(), explained.clamp(0.0, 1.0).float()


class FoldProjectors:
    """Loaded projectors: alpha[layer] and explained[layer], numpy [E, E] float32 each."""

    def __init__(self, alpha: dict[int, np.ndarray], explained: dict[int, np.ndarray], meta: dict[str, str]) -> None:
        self.alpha, self.explained, self.meta = alpha, explained, meta

    @staticmethod
    def path_for(model_dir: str) -> str:
        return os.path.join(model_dir, FILE_NAME)

    def save(self, path: str) -> None:
        tensors = {}
        for layer in sorted(self.alpha):
            tensors[f"layers.{layer}.alpha"] = torch.from_numpy(np.ascontiguousarray(self.alpha[layer]))
            tensors[f"layers.{layer}.explained"] = torch.from_numpy(np.ascontiguousarray(self.explained[layer]))
        save_file(tensors, path, metadata={"format": FORMAT, **self.meta})

    @classmethod
    def load(cls, path: str, layers: list[int], num_experts: int) -> "FoldProjectors":
        """Read `path` for a model with routed-expert `layers` of `num_experts` experts.

        Raises:
            FileNotFoundError: no file (the message says how to make one).
            ValueError: an unreadable file, another format, projectors of another shape
                (another model) or values that are not finite.
        """
        if not os.path.exists(path):
            raise FileNotFoundError(f"no ExFold projectors at {path}; make them with "
                                    f"`moestream calibrate MODEL --text FILE` (or pass --exfold-projectors FILE)")
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(path, "pt") as f:
                meta = f.metadata() or {}
            tensors = load_file(path) if meta.get("format") == FORMAT else {}
        except SafetensorError as e:
            raise ValueError(f"{path} is not a readable safetensors file ({e}); recalibrate with "
                             f"`moestream calibrate`") from e
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not an ExFold projector file (format {meta.get('format')!r}, "
                             f"expected {FORMAT!r})")
        alpha, explained = {}, {}
        shape = (num_experts, num_experts)
        for layer in layers:
            a, x = tensors.get(f"layers.{layer}.alpha"), tensors.get(f"layers.{layer}.explained")
            if a is None or x is None or tuple(a.shape) != shape or tuple(x.shape) != shape:
                raise ValueError(f"{path} does not fit this model: layer {layer} needs [{num_experts}, "
                                 f"{num_experts}] projectors; recalibrate with `moestream calibrate`")
            if not (torch.isfinite(a).all() and torch.isfinite(x).all()):
                raise ValueError(f"{path}: layer {layer}'s projectors are not finite; recalibrate")
            alpha[layer], explained[layer] = a.numpy(), x.numpy()
        return cls(alpha, explained, meta)

    def best(self, layer: int, experts: np.ndarray, allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each excluded expert experts [n] and its allowed targets allowed [n, E] bool
        (at least one each): (target [n] int64, alpha [n] float32), the allowed target of
        largest `explained` (ties: the lowest id)."""
        fit = np.where(allowed, self.explained[layer][experts], -1.0)  # [n, E]
        target = fit.argmax(axis=1)
        return target.astype(np.int64), self.alpha[layer][experts, target].astype(np.float32)
