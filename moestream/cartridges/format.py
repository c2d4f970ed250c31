"""The cartridge file: a KV prefix of p positions for one model, in safetensors.

A cartridge (Eyuboglu et al. 2025, "Cartridges: Lightweight and general-purpose long context
representations via self-study", arXiv 2506.06266) stands in for a document: requests start
after its p positions, as if the document had been computed before them. The file holds, per
attention layer of the model (in the order of `ModelConfig.attention_layers`; a looped
model's (layer, pass) cache layers), the cache entries of those p positions exactly as the
engine's paged KV cache holds them:

- `layers.{i}.keys` [p, kv_heads, head_dim] (after RoPE and any key norm) and
  `layers.{i}.values` [p, kv_heads, v_head_dim];
- multi-head latent attention (DeepSeek-V2/V3, Kimi): `layers.{i}.latent` [p, 1,
  kv_lora_rank + qk_rope_head_dim] instead (the compressed latent, its rotary part last);
- hybrid models: `states.{j}.{name}`, each linear-attention layer j's state tensors
  (Gated DeltaNet: `conv` and `recurrent`; Mamba-2, KDA: theirs) after the p-th position;
- `token_ids` [p] int64: the document's tokens, for a `prefix` cartridge only;
- `router.log_odds` [V] float32: the router's per-token log ratio (`cartridges/router.py`),
  with its threshold in the metadata (`router_threshold`); absent for a cartridge without one.

Its string metadata: `format` ("moestream-cartridge"), `version` ("1"), `id`, `num_tokens`
(p), `model_hash` (`model_fingerprint` of the checkpoint it was built on), `dtype` (of the
KV tensors), `builder` (prefix, knorm or train, with its options as JSON in
`builder_args`), `position_offset` (the position of its first entry: 0, or the end of the
cartridge it continues), `base` (the id of that cartridge, "" for none) and `base_digest`
(its file's sha256).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moestream.cartridges.router import CartridgeRouter

FORMAT = "moestream-cartridge"
VERSION = "1"
BUILDERS = ("prefix", "knorm", "train")
_FINGERPRINT_BYTES = 1 << 16


class CartridgeError(ValueError):
    """A cartridge that cannot be used: unreadable, corrupt, from another model, of another
    shape, or composed in a way the model cannot follow."""


@dataclass(frozen=True)
class Cartridge:
    """A loaded cartridge (host tensors).

    Attributes:
        id: its name (the file's stem unless set at build time).
        num_tokens: p, the positions it fills.
        model_hash: `model_fingerprint` of the checkpoint it belongs to.
        builder: how it was made: "prefix", "knorm" or "train".
        keys: per attention layer [p, heads, k_dim] in `dtype` (MLA: the latent).
        values: per attention layer [p, heads, v_dim] (MLA: [p, 1, 0]).
        states: hybrid models: the linear layers' state tensors after position
            `position_offset + p`, layer by layer in spec order (`StatePool.read_row`'s
            order); () for attention-only models.
        position_offset: the position of its first entry (0 unless it continues `base`).
        base: the id of the cartridge it was built after ("" for none).
        token_ids: the document's token ids (prefix cartridges), else None.
        digest: sha256 of the file's bytes (hex): the cartridge's identity in block hashes.
        builder_args: the builder's options.
        path: the file it was read from.
        router: its `CartridgeRouter` (`cartridge_routing: "auto"`), or None.
        base_digest: the digest of the cartridge it was built after ("" for none).
    """

    id: str
    num_tokens: int
    model_hash: str
    builder: str
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    states: tuple[torch.Tensor, ...] = ()
    position_offset: int = 0
    base: str = ""
    token_ids: tuple[int, ...] | None = None
    digest: str = ""
    builder_args: dict = field(default_factory=dict)
    path: str = ""
    router: CartridgeRouter | None = None
    base_digest: str = ""

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def kv_bytes(self) -> int:
        """Bytes of its KV entries (what it adds to the KV cache, before block rounding)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def model_fingerprint(model_dir: str) -> str:
    """A checkpoint's identity for cartridges (hex sha256): its `config.json` bytes and, for
    each weight file (the shard index's files, else every `*.safetensors` but ExFold's
    projectors), its safetensors header and first 64 KiB of tensor data. Two checkpoints of
    one architecture with different weights differ in it; reading it costs a few reads.

    Raises:
        CartridgeError: no config.json or no readable weight file.
    """
    h = hashlib.sha256()
    try:
        with open(os.path.join(model_dir, "config.json"), "rb") as f:
            h.update(f.read())
        index = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(n for n in os.listdir(model_dir)
                           if n.endswith(".safetensors") and n != "exfold_projectors.safetensors")
        for name in files:
            with open(os.path.join(model_dir, name), "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                h.update(f.read(size + _FINGERPRINT_BYTES))
    except (OSError, ValueError, KeyError) as e:
        raise CartridgeError(f"cannot fingerprint the checkpoint in '{model_dir}': {e}") from e
    if not files:
        raise CartridgeError(f"no safetensors weights in '{model_dir}' to fingerprint")
    return h.hexdigest()


def save_cartridge(path: str, cart: Cartridge, state_names: tuple[str, ...] = (), mla: bool = False) -> str:
    """Write `cart` to `path` (safetensors). `state_names`: the state tensors' names per
    linear layer, in spec order; `mla`: store the keys as `latent` (values are empty).
    Returns the file's digest (hex sha256).

    Raises:
        CartridgeError: tensors of inconsistent lengths, or states not a whole number of layers.
    """
    p = cart.num_tokens
    if any(t.shape[0] != p for t in (*cart.keys, *cart.values)):
        raise CartridgeError(f"every layer's keys and values must hold {p} positions")
    if state_names and len(cart.states) % len(state_names):
        raise CartridgeError(f"{len(cart.states)} state tensors are not whole layers of {state_names}")
    tensors: dict[str, torch.Tensor] = {}
    for i, (k, v) in enumerate(zip(cart.keys, cart.values, strict=True)):
        if mla:
            tensors[f"layers.{i}.latent"] = k.contiguous()
        else:
            tensors[f"layers.{i}.keys"] = k.contiguous()
            tensors[f"layers.{i}.values"] = v.contiguous()
    for j, t in enumerate(cart.states):
        tensors[f"states.{j // len(state_names)}.{state_names[j % len(state_names)]}"] = t.contiguous()
    if cart.token_ids is not None:
        tensors["token_ids"] = torch.tensor(cart.token_ids, dtype=torch.int64)
    if cart.router is not None:
        tensors["router.log_odds"] = cart.router.log_odds.float().contiguous()
    meta = {"format": FORMAT, "version": VERSION, "id": cart.id, "num_tokens": str(p), "model_hash": cart.model_hash,
            "dtype": str(cart.dtype).removeprefix("torch."), "builder": cart.builder,
            "builder_args": json.dumps(cart.builder_args, sort_keys=True), "position_offset": str(cart.position_offset),
            "base": cart.base, "base_digest": cart.base_digest, "num_layers": str(len(cart.keys)),
            "state_names": ",".join(state_names), "mla": "1" if mla else "0",
            **({"router_threshold": repr(cart.router.threshold)} if cart.router is not None else {})}
    save_file(tensors, path, metadata=meta)
    return _file_digest(path)


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_cartridge(path: str) -> Cartridge:
    """Read a cartridge file (host tensors). Its fit to a model is `check_cartridge`'s.

    Raises:
        CartridgeError: a missing, unreadable or corrupt file, or one that is not a
            moestream cartridge of a known version, with the reason.
    """
    if not os.path.isfile(path):
        raise CartridgeError(f"cartridge file '{path}' does not exist")
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            if meta.get("format") != FORMAT:
                raise CartridgeError(f"'{path}' is not a moestream cartridge (metadata format "
                                     f"{meta.get('format')!r}, expected {FORMAT!r})")
            if meta.get("version") != VERSION:
                raise CartridgeError(f"cartridge '{path}' has format version {meta.get('version')!r}; this moestream "
                                     f"reads version {VERSION}: rebuild it with `moestream cartridge build`")
            p, num_layers = int(meta["num_tokens"]), int(meta["num_layers"])
            mla = meta.get("mla") == "1"
            state_names = tuple(n for n in meta.get("state_names", "").split(",") if n)
            keys, values = [], []
            for i in range(num_layers):
                if mla:
                    k = f.get_tensor(f"layers.{i}.latent")
                    v = k.new_empty((k.shape[0], k.shape[1], 0))
                else:
                    k, v = f.get_tensor(f"layers.{i}.keys"), f.get_tensor(f"layers.{i}.values")
                keys.append(k)
                values.append(v)
            num_state_layers = len({n.split(".")[1] for n in names if n.startswith("states.")})
            states = [f.get_tensor(f"states.{j}.{s}") for j in range(num_state_layers) for s in state_names]
            token_ids = tuple(f.get_tensor("token_ids").tolist()) if "token_ids" in names else None
            offset, base, builder = int(meta["position_offset"]), meta["base"], meta["builder"]
            cid, model_hash = meta["id"], meta["model_hash"]
            builder_args = json.loads(meta.get("builder_args") or "{}")
            router = None
            if "router.log_odds" in names:
                log_odds = f.get_tensor("router.log_odds")
                if log_odds.dim() != 1 or not log_odds.is_floating_point():
                    raise CartridgeError(f"cartridge '{path}' is corrupt: router.log_odds must be a 1-D float tensor")
                router = CartridgeRouter(log_odds.float(), float(meta["router_threshold"]))
            base_digest = meta.get("base_digest", "")
    except CartridgeError:
        raise
    except Exception as e:  # safetensors' own errors, a missing key, a bad number
        raise CartridgeError(f"cartridge '{path}' is unreadable or corrupt ({type(e).__name__}: {e}); "
                             "rebuild it with `moestream cartridge build`") from e
    bad = [i for i, (k, v) in enumerate(zip(keys, values)) if k.dim() != 3 or v.dim() != 3 or k.shape[0] != p
           or v.shape[0] != p or k.shape[1] != v.shape[1]]
    if p < 1 or bad or builder not in BUILDERS or (token_ids is not None and len(token_ids) != p):
        raise CartridgeError(f"cartridge '{path}' is corrupt: p={p}, builder {builder!r}, layers with bad shapes "
                             f"{bad[:4]}; rebuild it with `moestream cartridge build`")
    return Cartridge(cid, p, model_hash, builder, tuple(keys), tuple(values), tuple(states), offset, base, token_ids,
                     _file_digest(path), builder_args, path, router, base_digest)
