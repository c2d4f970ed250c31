"""Checkpoint loading: safetensors read in place (single file or sharded index), no
conversion and no pickle. Dense weights become model parameters; routed experts are
either stacked into a ResidentExpertStore or located by byte offset for paging. Every
error names the file and the tensor."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import safe_open
from torch import nn
from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from moestream.config import ModelConfig
from moestream.experts.interface import ExpertStore, PackedExpert, PackedLayout
from moestream.experts.resident import ResidentExpertStore
from moestream.experts.tiers import DiskTier, TensorLocation, read_safetensors_header
from moestream.layers.attention_backend import AttentionBackend
from moestream.layers.router import TopKRouter
from moestream.models.moe_decoder import MoEForCausalLM
from moestream.models.registry import get_model_class
from moestream.quantization.method import PartSpec, QuantMethod
from moestream.quantization.packed import packed_layout

logger = logging.getLogger(__name__)


# The weight dtypes moestream reads; anything else (int8/int32/uint8/bool/float8 ...) is a quantized checkpoint.
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class CheckpointReader:
    """Maps tensor names to the safetensors file holding them and reads them by name.

    Every tensor moestream reads passes through `locate`, the one place its shape and dtype
    are checked (dense weights and resident experts by `get`, paged experts by
    `expert_locations`).

    Raises:
        ValueError: no safetensors files, an unreadable index, an unreadable or truncated
            file, a missing tensor, a tensor of the wrong shape, or one whose dtype is not
            floating point (a quantized checkpoint). The message names the file and the tensor.
    """

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        index = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map: dict[str, str] = json.load(f)["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"cannot read shard index {index}: {e}") from e
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
            weight_map = {}
        if not files:
            raise ValueError(f"no *.safetensors files in '{model_dir}'; moestream reads safetensors checkpoints only")
        self._headers: dict[str, dict[str, TensorLocation]] = {}
        self._handles = {}
        for name in files:
            path = os.path.join(model_dir, name)
            # names the file, and the tensor that runs past its end if one does
            self._headers[name] = read_safetensors_header(path)
            try:
                self._handles[name] = safe_open(path, framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise ValueError(f"cannot read safetensors file '{path}' (unreadable or truncated?): {e}") from e
        if not weight_map:
            weight_map = {key: name for name, header in self._headers.items() for key in header}
        self.weight_map = weight_map

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype of tensor `name` (which must be in the checkpoint)."""
        return self._headers[self.weight_map[name]][name].dtype

    def locate(self, name: str, shape: Sequence[int], part: PartSpec | None = None, quantized: str = "") -> TensorLocation:
        """Where tensor `name` lies, checking it has `shape` and a floating-point dtype, or
        for a stored tensor of a quantized weight (`part`, of the format `quantized`), one
        of the part's shapes (each after the leading `shape`, e.g. [E] of fused experts)
        and dtypes.

        Raises:
            ValueError: the tensor is missing, has another shape, or has a dtype outside
                FLOAT_DTYPES (names the tensor, the file and the dtype).
        """
        if name not in self.weight_map:
            if part is not None:
                raise ValueError(f"checkpoint '{self.model_dir}' has no tensor '{name}', which its {quantized} "
                                 "weight needs (missing scales or quantized values: is the checkpoint complete?)")
            raise ValueError(f"checkpoint '{self.model_dir}' has no tensor '{name}'")
        path = os.path.join(self.model_dir, self.weight_map[name])
        loc = self._headers[self.weight_map[name]].get(name)
        if loc is None:
            raise ValueError(f"tensor '{name}' is mapped to '{path}' but that file does not hold it")
        if part is not None:
            shapes = [[*shape, *s] for s in part.shapes]
            if list(loc.shape) not in shapes:
                raise ValueError(f"tensor '{name}' in '{path}' has shape {list(loc.shape)}; its {quantized} weight "
                                 f"needs {' or '.join(map(str, shapes))}")
            if loc.dtype not in part.dtypes:
                raise ValueError(f"tensor '{name}' in '{path}' has dtype {str(loc.dtype).removeprefix('torch.')}; "
                                 f"its {quantized} weight needs "
                                 f"{' or '.join(str(d).removeprefix('torch.') for d in part.dtypes)}")
            return loc
        if list(loc.shape) != list(shape):
            raise ValueError(f"tensor '{name}' in '{path}' has shape {list(loc.shape)}, expected {list(shape)}")
        if loc.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"tensor '{name}' in '{path}' has dtype {str(loc.dtype).removeprefix('torch.')}; moestream loads only "
                "floating-point weights (float32, bfloat16, float16, float64) unless config.json's "
                "quantization_config names the format (see docs/quantization.md)"
            )
        return loc

    def get(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        """Read tensor `name`, checked by `locate`. Returns a CPU tensor in the file's dtype.

        Raises:
            ValueError: see `locate`, or the tensor's bytes cannot be read.
        """
        return self._read(name, self.locate(name, shape))

    def _read(self, name: str, loc: TensorLocation) -> torch.Tensor:
        try:
            return self._handles[self.weight_map[name]].get_tensor(name)
        except Exception as e:
            raise ValueError(f"cannot read tensor '{name}' from '{loc.path}' (unreadable or truncated?): {e}") from e

    def get_weight(self, name: str, shape: Sequence[int], method: QuantMethod | None) -> torch.Tensor:
        """Read a weight: as `get`, or, when `method` says that this [out, in] `.weight` is
        stored quantized, its stored tensors dequantized to float32 (dense layers of a
        quantized checkpoint: dequantized once, at load).

        Raises:
            ValueError: see `locate` (a stored tensor missing, misshapen or of the wrong dtype).
        """
        base = name.removesuffix(".weight")
        if method is None or method.experts_only or base == name or len(shape) != 2 or not method.is_quantized(self, base):
            return self.get(name, shape)
        out_in = (shape[0], shape[1])
        parts = {suffix: self._read(base + suffix, self.locate(base + suffix, (), spec, method.name))
                 for suffix, spec in method.parts(base, out_in).items()}
        return method.dequantize(parts, out_in)


def build_model(
    cfg: ModelConfig, reader: CheckpointReader, dtype: torch.dtype, device: torch.device,
    backend: AttentionBackend, store: ExpertStore, method: QuantMethod | None = None,
) -> MoEForCausalLM:
    """Build the model for `cfg` and fill its dense parameters from the checkpoint.

    The model is built on the meta device, so no memory is spent on initialisation; each
    parameter is then read straight into place. Routed experts are not touched: they are
    the `store`'s (see `load_resident_experts` and `expert_locations`).

    Raises:
        ValueError: see CheckpointReader (a missing, misshapen or non-float tensor, or an
            unreadable file).
    """
    with torch.device("meta"):
        model = get_model_class(cfg.model_type)(cfg, backend, store, device)
    params = list(model.named_parameters())
    for name, p in tqdm(params, desc="Loading dense weights", unit="tensor", disable=None):
        names = model.hf_names(name)
        hf = next((n for n in names if n in reader), names[0])
        if hf == "lm_head.weight" and cfg.tie_word_embeddings and hf not in reader:
            hf = "model.embed_tokens.weight"
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        # HF keeps DeepSeek's and GLM's routers in float32 (`_keep_in_fp32_modules_strict`)
        keep_fp32 = isinstance(module, TopKRouter) and module.config.float32
        tensor = reader.get_weight(hf, p.shape, method).to(device=device, dtype=torch.float32 if keep_fp32 else dtype)
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    _log_unread_layers(cfg, reader)
    model.eval()
    return model


def _log_unread_layers(cfg: ModelConfig, reader: CheckpointReader) -> None:
    """Log the tensors of decoder layers past `num_hidden_layers`: the multi-token-prediction
    (next-n) layers DeepSeek-V3 and GLM-4.5 checkpoints append as `model.layers.{L}.*`."""
    prefix = cfg.weight_prefix + "layers."
    extra: dict[int, int] = {}
    for name in reader.weight_map:
        if name.startswith(prefix):
            idx = name[len(prefix):].split(".", 1)[0]
            if idx.isdigit() and int(idx) >= cfg.num_layers:
                extra[int(idx)] = extra.get(int(idx), 0) + 1
    if extra:
        layers = ", ".join(f"{prefix}{i} ({n} tensors)" for i, n in sorted(extra.items()))
        logger.info("not loading %s: layers past num_hidden_layers=%d are not part of the model (in DeepSeek-V3 "
                    "and GLM-4.5 checkpoints, the multi-token-prediction / next-n layers)", layers, cfg.num_layers)


def _expert_names(cfg: ModelConfig, layer: int, expert: int) -> tuple[str, str, str]:
    names = (n.format(l=layer, e=expert) for n in get_model_class(cfg.model_type).expert_names)
    return tuple(_prefixed(cfg, n) for n in names)  # type: ignore[return-value]


def _prefixed(cfg: ModelConfig, name: str) -> str:
    """`name` with its leading "model." replaced by the config's `weight_prefix`."""
    return cfg.weight_prefix + name[len("model."):] if name.startswith("model.") else name




def _transposed(cfg: ModelConfig) -> bool:
    """Whether the model's fused expert tensors are stored x @ W ([E, H, 2I], [E, I, H])."""
    return get_model_class(cfg.model_type).fused_experts_transposed


def _fused_names(cfg: ModelConfig, reader: CheckpointReader, layer: int) -> tuple[str, str] | None:
    """The fused 3-D expert tensors of `layer` when the checkpoint stores them instead of
    per-expert ones (a per-expert name wins when both are present); else None."""
    if _expert_names(cfg, layer, 0)[1] in reader:  # the up projection: every expert has one
        return None
    gate_up, down = (_prefixed(cfg, n.format(l=layer)) for n in get_model_class(cfg.model_type).fused_expert_names)
    return (gate_up, down) if gate_up in reader else None


def load_resident_experts(
    cfg: ModelConfig, reader: CheckpointReader, dtype: torch.dtype, device: torch.device, store: ResidentExpertStore
) -> None:
    """Stack every layer's routed experts into `store` (gate_up [E, 2I, H] (ungated experts:
    [E, I, H], the up projection), down [E, H, I]),
    from per-expert tensors or the fused 3-D ones (the model class's `fused_expert_names`; transposed for a
    model class with `fused_experts_transposed`, gpt-oss, and transposed back here).

    Raises:
        ValueError: see CheckpointReader (a missing, misshapen or non-float tensor, or an
            unreadable file).
    """
    inter, hidden, num, rows = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts, cfg.gate_up_rows
    moe_layers = [i for i, m in enumerate(cfg.moe_layers) if m]
    with tqdm(total=len(moe_layers) * num, desc="Loading experts", unit="expert", disable=None) as bar:
        for layer in moe_layers:
            split = get_model_class(cfg.model_type).split_expert_tensors(cfg, layer)
            if split is not None:  # gate, up [E, H, I] and down [E, I, H], multiplied as x @ W
                gate, up = (reader.get(n, (num, hidden, inter)).to(device=device, dtype=dtype) for n in split[:2])
                down = reader.get(split[2], (num, inter, hidden)).to(device=device, dtype=dtype)
                store.set_layer(layer, torch.cat((gate, up), dim=2).transpose(1, 2).contiguous(),
                                down.transpose(1, 2).contiguous())
                bar.update(num)
                continue
            fused = _fused_names(cfg, reader, layer)
            if fused is not None and _transposed(cfg):  # [E, H, 2I] and [E, I, H], multiplied as x @ W
                gate_up = reader.get(fused[0], (num, hidden, 2 * inter)).to(device=device, dtype=dtype)
                down = reader.get(fused[1], (num, inter, hidden)).to(device=device, dtype=dtype)
                store.set_layer(layer, gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous())
                bar.update(num)
                continue
            if fused is not None:
                gate_up = reader.get(fused[0], (num, rows, hidden)).to(device=device, dtype=dtype)
                down = reader.get(fused[1], (num, hidden, inter)).to(device=device, dtype=dtype)
                store.set_layer(layer, gate_up, down)
                bar.update(num)
                continue
            gate_up = torch.empty(num, rows, hidden, dtype=dtype, device=device)  # [E, 2I, H] ([E, I, H] ungated)
            down = torch.empty(num, hidden, inter, dtype=dtype, device=device)  # [E, H, I]
            for e in range(num):
                gate_name, up_name, down_name = _expert_names(cfg, layer, e)
                if rows > inter:
                    gate_up[e, :inter] = reader.get(gate_name, (inter, hidden))
                gate_up[e, rows - inter:] = reader.get(up_name, (inter, hidden))
                down[e] = reader.get(down_name, (hidden, inter))
                bar.update()
            store.set_layer(layer, gate_up, down)


def expert_locations(
    cfg: ModelConfig, reader: CheckpointReader
) -> dict[tuple[int, int], tuple[TensorLocation, TensorLocation, TensorLocation]]:
    """(layer, expert) -> byte locations of its gate, up and down weights, for paging from disk.
    With fused 3-D tensors (the model class's `fused_expert_names`) these are slices of them: expert e's gate
    and up are rows [e, :I] and [e, I:] of gate_up_proj, its down is down_proj[e], each
    contiguous in the file, so they are read in place. Ungated experts (Nemotron-H) have no
    gate: its location is None. Transposed fused tensors (gpt-oss)
    give two locations, gate_up_proj[e] [H, 2I] and down_proj[e] [I, H], which
    `DiskTier.read_into` transposes as it copies.

    Raises:
        ValueError: see `CheckpointReader.locate` (a missing, misshapen or non-float tensor;
            names the file and the tensor).
    """
    inter, hidden, num = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts
    out = {}
    for layer in (i for i, m in enumerate(cfg.moe_layers) if m):
        split = get_model_class(cfg.model_type).split_expert_tensors(cfg, layer)
        if split is not None:  # slices [e] of gate, up [E, H, I] and down [E, I, H], read transposed
            whole = [reader.locate(n, (num, hidden, inter)) for n in split[:2]] + [reader.locate(split[2], (num, inter, hidden))]
            for e in range(num):
                out[(layer, e)] = tuple(
                    dataclasses.replace(loc, name=f"{loc.name}[{e}]", offset=loc.offset + e * (loc.nbytes // num),
                                        nbytes=loc.nbytes // num, shape=loc.shape[1:], transposed=True)
                    for loc in whole)
            continue
        fused = _fused_names(cfg, reader, layer)
        if fused is not None and _transposed(cfg):
            gate_up, down = reader.locate(fused[0], (num, hidden, 2 * inter)), reader.locate(fused[1], (num, inter, hidden))
            per_expert = gate_up.nbytes // num  # bytes of one [H, 2I]; a [I, H] is half of it
            for e in range(num):
                out[(layer, e)] = (
                    dataclasses.replace(gate_up, name=f"{gate_up.name}[{e}]", offset=gate_up.offset + e * per_expert,
                                        nbytes=per_expert, shape=(hidden, 2 * inter)),
                    dataclasses.replace(down, name=f"{down.name}[{e}]", offset=down.offset + e * (per_expert // 2),
                                        nbytes=per_expert // 2, shape=(inter, hidden)),
                )
            continue
        if fused is not None:
            parts = cfg.gate_up_rows // inter  # 2: gate and up; 1: up alone (ungated)
            gate_up, down = reader.locate(fused[0], (num, parts * inter, hidden)), reader.locate(fused[1], (num, hidden, inter))
            size = gate_up.nbytes // (num * parts * inter * hidden)  # bytes per element
            block = inter * hidden * size  # bytes of one [I, H] or [H, I] matrix
            for e in range(num):
                out[(layer, e)] = (
                    dataclasses.replace(gate_up, name=f"{gate_up.name}[{e}, :{inter}]",
                                        offset=gate_up.offset + 2 * e * block, nbytes=block, shape=(inter, hidden))
                    if parts == 2 else None,
                    dataclasses.replace(gate_up, name=f"{gate_up.name}[{e}, {inter * (parts - 1)}:]",
                                        offset=gate_up.offset + (parts * e + parts - 1) * block, nbytes=block,
                                        shape=(inter, hidden)),
                    dataclasses.replace(down, name=f"{down.name}[{e}]", offset=down.offset + e * block, nbytes=block,
                                        shape=(hidden, inter)),
                )
            continue
        for e in range(num):
            gate, up, down = _expert_names(cfg, layer, e)
            out[(layer, e)] = (reader.locate(gate, (inter, hidden)) if cfg.expert_activation.gated else None,
                               reader.locate(up, (inter, hidden)), reader.locate(down, (hidden, inter)))
    return out


def packed_experts(
    cfg: ModelConfig, reader: CheckpointReader, method: QuantMethod | None
) -> tuple[PackedLayout, dict[tuple[int, int], tuple[TensorLocation, ...]]] | None:
    """A quantized checkpoint's routed experts, kept packed: the layout of one expert's stored
    tensors and (layer, expert) -> their byte locations, in the layout's order. Per-expert
    tensors (`{gate,up,down}_proj` + the format's suffixes), or for formats stored fused
    (`method.fused_experts`: MXFP4) slices [e] of the layer's `gate_up_proj{suffix}` [E, ...]
    and `down_proj{suffix}` [E, ...], each contiguous in the file. None when the experts
    are not stored quantized (no `method`, or the config leaves them unquantized).

    Raises:
        ValueError: a stored tensor missing, misshapen or of the wrong dtype (see
            `CheckpointReader.locate`); names the tensor and the file.
    """
    if method is None:
        return None
    inter, hidden, num = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts
    moe_layers = [i for i, m in enumerate(cfg.moe_layers) if m]
    if method.fused_experts:
        matrices = (("gate_up", (2 * inter, hidden)), ("down", (hidden, inter)))
        def bases(layer: int, e: int) -> tuple[str, ...]:
            return tuple(_prefixed(cfg, n.format(l=layer)) for n in get_model_class(cfg.model_type).fused_expert_names)
    else:
        matrices = (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter)))
        def bases(layer: int, e: int) -> tuple[str, ...]:
            return tuple(n.removesuffix(".weight") for n in _expert_names(cfg, layer, e))
    if not method.is_quantized(reader, bases(moe_layers[0], 0)[-1]):
        return None
    if not cfg.expert_activation.gated:
        raise ValueError(f"this checkpoint's routed experts are stored quantized ({method.name}); quantized ungated "
                         f"experts ({cfg.model_type}) are not supported yet: use a bf16 checkpoint")
    lead = (num,) if method.fused_experts else ()  # fused tensors: [E, *part shape]

    def locate(layer: int, e: int) -> list[tuple[str, str, TensorLocation]]:
        """(matrix, suffix, location) of each stored part of expert e (fused: of the layer)."""
        return [(matrix, suffix, reader.locate(base + suffix, lead, spec, method.name))
                for (matrix, shape), base in zip(matrices, bases(layer, e), strict=True)
                for suffix, spec in method.parts(base, shape).items()]

    layout = packed_layout(method, matrices, [(m, suffix, loc.dtype, loc.shape[len(lead):])
                                              for m, suffix, loc in locate(moe_layers[0], 0)])
    out: dict[tuple[int, int], tuple[TensorLocation, ...]] = {}
    for layer in moe_layers:
        if method.fused_experts:
            fused = [loc for _, _, loc in locate(layer, 0)]
            for e in range(num):
                out[(layer, e)] = tuple(
                    dataclasses.replace(loc, name=f"{loc.name}[{e}]", offset=loc.offset + e * part.nbytes,
                                        nbytes=part.nbytes, shape=part.shape)
                    for loc, part in zip(fused, layout.parts, strict=True))
            continue
        for e in range(num):
            locs = tuple(loc for _, _, loc in locate(layer, e))
            for loc, part in zip(locs, layout.parts, strict=True):
                if loc.dtype != part.dtype or loc.shape != part.shape:
                    raise ValueError(f"tensor '{loc.name}' in '{loc.path}' is {str(loc.dtype).removeprefix('torch.')} "
                                     f"{list(loc.shape)}, unlike the other experts' "
                                     f"{str(part.dtype).removeprefix('torch.')} {list(part.shape)}")
            out[(layer, e)] = locs
    return layout, out


def load_packed_experts(
    layout: PackedLayout, locations: dict[tuple[int, int], tuple[TensorLocation, ...]], num_experts: int,
    device: torch.device, store: ResidentExpertStore,
) -> None:
    """Read every routed expert's packed bytes into `store` ([E, nbytes] uint8 per layer),
    straight from the files by offset (`DiskTier.read_packed`)."""
    disk = DiskTier(locations)
    layers = sorted({layer for layer, _ in locations})
    with tqdm(total=len(locations), desc="Loading experts", unit="expert", disable=None) as bar:
        for layer in layers:
            data = torch.empty(num_experts, layout.nbytes, dtype=torch.uint8, device=device)  # [E, nbytes]
            for e in range(num_experts):
                disk.read_packed((layer, e), PackedExpert(data[e], layout))
                bar.update()
            store.set_packed_layer(layer, data, layout)
    disk.close()


def _config_for_tokenizer(model_dir: str) -> dict[str, Any]:
    """`config=` for AutoTokenizer when transformers has no config class for the checkpoint's
    model_type (loop-moe): an empty config, so that the tokenizer files alone choose the
    tokenizer, without transformers' warning that it loads the config as another type."""
    from transformers import CONFIG_MAPPING, PretrainedConfig

    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return {}
    return {} if model_type in CONFIG_MAPPING else {"config": PretrainedConfig()}


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    """AutoTokenizer from the checkpoint directory.

    Raises:
        ValueError: the directory has no usable tokenizer files, or transformers rejects its
            config.json (AutoTokenizer reads it to choose the tokenizer class). One line.
    """
    vocab_files = ("tokenizer.json", "tokenizer.model", "vocab.json")
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in vocab_files):
        # transformers would build an empty tokenizer from the config's model_type instead of failing.
        raise ValueError(
            f"'{model_dir}' has no tokenizer: none of {', '.join(vocab_files)} is there. Copy the model's "
            "tokenizer files (tokenizer.json and tokenizer_config.json) into the checkpoint directory"
        )
    try:
        return AutoTokenizer.from_pretrained(model_dir, **_config_for_tokenizer(model_dir))
    except StrictDataclassError as e:  # a config.json field transformers validates, not a tokenizer file
        path, detail = os.path.join(model_dir, "config.json"), " ".join(str(e).split())
        raise ValueError(f"config.json at {path}: transformers rejects it: {detail}") from e
    except Exception as e:
        raise ValueError(
            f"cannot load a tokenizer from '{model_dir}': {' '.join(str(e).split())}. The checkpoint directory "
            "must hold the tokenizer files (tokenizer.json and tokenizer_config.json)"
        ) from e
