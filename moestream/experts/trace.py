"""Routing traces: the trace format (`RoutingTrace`, and the DeepSeek prompt-routing loader)
and the live `RoutingRecorder`. The offline replay against Belady's optimum is `trace_sim`.

Trace file (our own `.npz`): `layer` [N] int16, `offsets` [N+1] int64, `experts` [M] int16;
access i is layer `layer[i]` asking for `experts[offsets[i]:offsets[i+1]]`. Optional `request`
[N] int32 and `token` [N] int32 say whose token (request index, position) it was, and
`loop_pass` [N] int16 (saved as `pass`) which pass of a looped model's stack it was (looped
MoE: the R passes of a stack layer share its experts and its `layer`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch

Access = tuple[int, tuple[int, ...]]  # (layer, expert ids)


class RoutingTrace:
    """An ordered list of accesses (layer, expert ids), with optional per-access request index
    and token position (both None, or both of length N)."""

    def __init__(self, layer: np.ndarray, offsets: np.ndarray, experts: np.ndarray,
                 request: np.ndarray | None = None, token: np.ndarray | None = None,
                 loop_pass: np.ndarray | None = None) -> None:
        self.layer = np.asarray(layer, dtype=np.int16)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.experts = np.asarray(experts, dtype=np.int16)
        n = len(self.layer)
        if len(self.offsets) != n + 1 or self.offsets[0] != 0 or self.offsets[-1] != len(self.experts):
            raise ValueError(f"offsets must have N+1 = {n + 1} entries from 0 to {len(self.experts)}")
        self.request = None if request is None else np.asarray(request, dtype=np.int32)
        self.token = None if token is None else np.asarray(token, dtype=np.int32)
        self.loop_pass = None if loop_pass is None else np.asarray(loop_pass, dtype=np.int16)
        for name, meta in (("request", self.request), ("token", self.token), ("pass", self.loop_pass)):
            if meta is not None and len(meta) != n:
                raise ValueError(f"{name} has {len(meta)} entries, expected {n}")

    @classmethod
    def from_accesses(cls, accesses: Iterable[Access], request: Sequence[int] | None = None,
                      token: Sequence[int] | None = None, loop_pass: Sequence[int] | None = None) -> RoutingTrace:
        """Build from (layer, expert ids) pairs."""
        layers, flat, offsets = [], [], [0]
        for layer, ids in accesses:
            layers.append(layer)
            flat.extend(ids)
            offsets.append(len(flat))
        return cls(np.array(layers, np.int16), np.array(offsets, np.int64), np.array(flat, np.int16),
                   None if request is None else np.array(request), None if token is None else np.array(token),
                   None if loop_pass is None else np.array(loop_pass))

    def __len__(self) -> int:
        return len(self.layer)

    def __iter__(self) -> Iterator[Access]:
        layers, offs, flat = self.layer.tolist(), self.offsets.tolist(), self.experts.tolist()
        for i, layer in enumerate(layers):
            yield layer, tuple(flat[offs[i]:offs[i + 1]])

    def __getitem__(self, i: int) -> Access:
        return int(self.layer[i]), tuple(self.experts[self.offsets[i]:self.offsets[i + 1]].tolist())

    @property
    def num_key_accesses(self) -> int:
        return len(self.experts)

    def distinct_keys(self) -> int:
        """Number of distinct (layer, expert) keys in the trace."""
        layer_of = np.repeat(self.layer.astype(np.int64), np.diff(self.offsets))
        return len(np.unique(layer_of * 65536 + self.experts.astype(np.int64)))

    def save(self, path: str) -> None:
        """Write the `.npz` described in the module docstring."""
        arrays = {"layer": self.layer, "offsets": self.offsets, "experts": self.experts}
        if self.request is not None:
            arrays["request"] = self.request
        if self.token is not None:
            arrays["token"] = self.token
        if self.loop_pass is not None:
            arrays["pass"] = self.loop_pass
        with open(path, "wb") as f:  # a file object keeps numpy from appending ".npz"
            np.savez(f, **arrays)

    @classmethod
    def load(cls, path: str) -> RoutingTrace:
        """Read a trace written by `save`. Raises KeyError when an array is missing."""
        with np.load(path) as z:
            return cls(z["layer"], z["offsets"], z["experts"],
                       z["request"] if "request" in z.files else None, z["token"] if "token" in z.files else None,
                       z["pass"] if "pass" in z.files else None)

    @classmethod
    def from_deepseek_npz(cls, path: str, interleave: int = 1,
                          max_prompts: int | None = None) -> RoutingTrace:
        """Read the DeepSeek-V2-Lite prompt-routing trace (`../shared/traces/README.md`: one
        `prompt_<n>` array [T, 26, 6] int8 per prompt, taken in order of n).

        Each token gives 26 accesses (layer 0..25, its 6 experts in router order). With
        `interleave=k`, k prompts run concurrently: each round, every active prompt emits its
        next token (in slot order) and a finished prompt's slot goes to the next waiting one.
        `request` = prompt index in that order, `token` = position in the prompt.

        Raises:
            ValueError: interleave < 1, or an array name is not `prompt_<n>`.
        """
        if interleave < 1:
            raise ValueError(f"interleave must be >= 1, got {interleave}")
        with np.load(path) as z:
            if not all(name.startswith("prompt_") and name[7:].isdigit() for name in z.files):
                raise ValueError(f"{path}: expected arrays named prompt_<n> only")
            names = sorted(z.files, key=lambda name: int(name[7:]))[:max_prompts]
            prompts = [z[name] for name in names]
        order: list[tuple[int, int]] = []  # (prompt, token) in serving order
        waiting = [p for p, a in enumerate(prompts) if len(a)][::-1]
        slots: list[list[int] | None] = [None] * interleave  # [prompt, next token]
        while waiting or any(slots):
            for i, slot in enumerate(slots):
                if slot is None and waiting:
                    slots[i] = slot = [waiting.pop(), 0]
                if slot is not None:
                    order.append((slot[0], slot[1]))
                    slot[1] += 1
                    if slot[1] == len(prompts[slot[0]]):
                        slots[i] = None
        if not order:
            return cls(np.zeros(0, np.int16), np.zeros(1, np.int64), np.zeros(0, np.int16))
        p_idx, t_idx = np.array(order).T
        tokens = np.concatenate(prompts)[np.cumsum([0] + [len(a) for a in prompts])[p_idx] + t_idx]  # [n, L, k]
        n, num_layers, k = tokens.shape
        return cls(np.tile(np.arange(num_layers, dtype=np.int16), n), np.arange(n * num_layers + 1) * k,
                   tokens.reshape(-1), np.repeat(p_idx, num_layers), np.repeat(t_idx, num_layers))


class RoutingRecorder:
    """Collects the router's choices during serving: one record per (request, token, layer).

    Either `record(request_ids, token_positions, layer, topk_ids)` per MoE layer call, or
    `begin_step(request_ids, token_positions)` once per model forward (the ModelRunner calls it
    just before each forward: a hybrid model's step may run as several forwards, one per group
    of resident states) and then `record_layer(layer, topk_ids)` per MoE layer call of that
    forward (rows [T] in the forward's flat token order).

    Looped MoE: a stack layer is called once per pass in a forward; `record_layer` counts
    the calls of each layer since `begin_step`, and the count is the pass.
    """

    def __init__(self) -> None:
        # (request, position) -> {(pass, layer): expert ids}, first-seen order
        self._tokens: dict[tuple[str, int], dict[tuple[int, int], tuple[int, ...]]] = {}
        self._steps: list[Access] = []
        self._step_ids: tuple[list[str], list[int]] = ([], [])
        self._calls: dict[int, int] = {}  # layer -> its calls since begin_step

    def begin_step(self, request_ids: Sequence[str], token_positions: Sequence[int]) -> None:
        """Name the rows of the coming forward's `record_layer` calls: row i of its flat batch
        [T] is token `token_positions[i]` [T] of request `request_ids[i]` [T]."""
        self._step_ids = (list(request_ids), list(token_positions))
        self._calls = {}

    def record_layer(self, layer: int, topk_ids: torch.Tensor) -> None:
        """`record` with the ids given to the last `begin_step`; `topk_ids` [T, k]. The
        layer's calls since then are its pass (0 but in a looped model's stack)."""
        loop_pass = self._calls.get(layer, 0)
        self._calls[layer] = loop_pass + 1
        self.record(*self._step_ids, layer, topk_ids, loop_pass)

    def record(self, request_ids: Sequence[str], token_positions: Sequence[int], layer: int,
               topk_ids: torch.Tensor, loop_pass: int = 0) -> None:
        """Record one MoE layer call: row i of `topk_ids` [T, k] is token `token_positions[i]` of
        request `request_ids[i]`. A recomputed token overwrites its earlier record.

        Raises:
            ValueError: lengths disagree.
        """
        rows = topk_ids.tolist()
        if not len(request_ids) == len(token_positions) == len(rows):
            raise ValueError(f"{len(request_ids)} request ids, {len(token_positions)} positions, {len(rows)} rows")
        for rid, pos, ids in zip(request_ids, token_positions, rows):
            self._tokens.setdefault((rid, int(pos)), {})[(loop_pass, layer)] = tuple(ids)
        self._steps.append((layer, tuple(sorted({e for ids in rows for e in ids}))))

    def to_trace(self, per_step: bool = False) -> RoutingTrace:
        """per_step=False: per token (first-seen order), its layers in the order they ran (passes
        in order, each pass's layers ascending), each with the router's top-k order, request
        index (first-seen order of ids), position and, for a looped model, the pass.
        per_step=True: one access per layer call, the sorted union of its tokens' experts (the
        order SparseMoE passes them to `ensure`), no metadata."""
        if per_step:
            return RoutingTrace.from_accesses(self._steps)
        req_index: dict[str, int] = {}
        accesses, request, token, passes = [], [], [], []
        for (rid, pos), layers in self._tokens.items():
            for loop_pass, layer in sorted(layers):
                accesses.append((layer, layers[(loop_pass, layer)]))
                request.append(req_index.setdefault(rid, len(req_index)))
                token.append(pos)
                passes.append(loop_pass)
        looped = any(passes)
        return RoutingTrace.from_accesses(accesses, request, token, passes if looped else None)

    def save(self, path: str, per_step: bool = False) -> None:
        """`to_trace(per_step).save(path)`."""
        self.to_trace(per_step).save(path)
