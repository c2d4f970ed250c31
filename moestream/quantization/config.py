"""`quantization_from_hf`: a `config.json`'s `quantization_config` -> `QuantizationConfig`,
refusing at start-up what moestream cannot read (the message names the field and what to
do). compressed-tensors configs are parsed by the compressed-tensors library."""

from __future__ import annotations

from typing import Any

from moestream.config.quantization import COMPRESSED_TENSORS_FORMATS, QUANT_METHODS, QuantizationConfig


def quantization_from_hf(raw: Any, where: str) -> QuantizationConfig:
    """Parse `quantization_config` (HF's dict) into a `QuantizationConfig`.

    Raises:
        ValueError: not a dict, an unknown `quant_method`, or bits, group sizes, block sizes,
            formats or strategies moestream does not read; names the field and `where`.
    """
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: quantization_config must be a JSON object, got {type(raw).__name__}")
    method = raw.get("quant_method")
    field = f"{where}: quantization_config"
    if method not in QUANT_METHODS:
        raise ValueError(f"{field} quant_method '{method}' is not supported; moestream reads "
                         f"{', '.join(QUANT_METHODS)} checkpoints (or unquantized float32 / bfloat16 / float16 ones)")
    if method == "fp8":
        return _fp8(raw, field)
    if method == "gptq":
        return _gptq(raw, field)
    if method == "mxfp4":
        return QuantizationConfig("mxfp4", ignore=tuple(raw.get("modules_to_not_convert") or ()))
    return _compressed_tensors(raw, field)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _fp8(raw: dict, field: str) -> QuantizationConfig:
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{field} fmt '{fmt}' is not supported; FP8 checkpoints must be e4m3 (float8_e4m3fn)")
    block = raw.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, list) and len(block) == 2 and all(_positive_int(b) for b in block)):
            raise ValueError(f"{field} weight_block_size must be two positive ints [rows, columns], got {block!r}")
        block = (block[0], block[1])
    ignore = raw.get("ignored_layers") or raw.get("modules_to_not_convert") or ()
    return QuantizationConfig("fp8", weight_block_size=block, ignore=tuple(ignore))


def _gptq(raw: dict, field: str) -> QuantizationConfig:
    bits, group = raw.get("bits"), raw.get("group_size", -1)
    if bits not in (4, 8):
        raise ValueError(f"{field} bits {bits!r} is not supported; GPTQ checkpoints must have 4 or 8 bits")
    if not (group == -1 or _positive_int(group)):
        raise ValueError(f"{field} group_size {group!r} is not supported; give -1 (per column) or a positive int")
    fmt = raw.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{field} checkpoint_format '{fmt}' is not supported; moestream reads 'gptq' and 'gptq_v2'")
    return QuantizationConfig("gptq", bits=bits, group_size=group, desc_act=bool(raw.get("desc_act", False)),
                              symmetric=bool(raw.get("sym", True)), zero_offset=1 if fmt == "gptq" else 0)


def _compressed_tensors(raw: dict, field: str) -> QuantizationConfig:
    from compressed_tensors.quantization import QuantizationConfig as CTConfig  # imports torch

    try:
        ct = CTConfig.model_validate(raw)
    except Exception as e:  # pydantic's ValidationError, or the library's own checks
        raise ValueError(f"{field}: compressed-tensors rejects it: {' '.join(str(e).split())}") from e
    if ct.format not in COMPRESSED_TENSORS_FORMATS:
        raise ValueError(f"{field} format '{ct.format}' is not supported; moestream reads "
                         f"{', '.join(COMPRESSED_TENSORS_FORMATS)}")
    weights = {g: s.weights for g, s in ct.config_groups.items()}
    if any(w is None for w in weights.values()) or len({w.model_dump_json() for w in weights.values()}) != 1:
        raise ValueError(f"{field}: every config group must quantize weights, with one scheme for all groups "
                         f"(got {', '.join(f'{g}: {w}' for g, w in weights.items())})")
    w = next(iter(weights.values()))
    strategy = str(w.strategy)
    if w.type == "int" and w.num_bits not in (4, 8):
        raise ValueError(f"{field} num_bits {w.num_bits} is not supported; int weights must have 4 or 8 bits")
    if w.type == "float" and (w.num_bits != 8 or ct.format != "float-quantized"):
        raise ValueError(f"{field}: float weights must be 8-bit in the float-quantized format, got "
                         f"{w.num_bits}-bit {ct.format}")
    if w.type == "int" and ct.format == "float-quantized":
        raise ValueError(f"{field}: int weights cannot be in the float-quantized format")
    if strategy not in ("group", "channel", "tensor"):
        raise ValueError(f"{field} weight strategy '{strategy}' is not supported; moestream reads group, channel "
                         "and tensor scales")
    if strategy == "group" and not _positive_int(w.group_size):
        raise ValueError(f"{field} group_size {w.group_size!r} must be a positive int for the group strategy")
    if w.actorder == "group":
        raise ValueError(f"{field} actorder 'group' (a weight_g_idx permutation) is not supported yet")
    return QuantizationConfig("compressed-tensors", format=ct.format, weight_type=str(w.type), bits=w.num_bits,
                              strategy=strategy, group_size=w.group_size or 0, symmetric=w.symmetric,
                              ignore=tuple(ct.ignore or ()))
