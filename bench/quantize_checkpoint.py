"""Quantize a float checkpoint into one of the formats moestream reads, and optionally write
its exact dequantization as a float32 checkpoint (the oracle HF runs in the tests).

Written from the formats' specs, independently of `moestream/quantization/`: each weight
is quantized here to integers / FP8 / FP4 codes and scales, the oracle's float32 weight is
computed from those codes and scales, and only then are the codes packed into the stored
layout (compressed-tensors' own `pack_to_int32` for its format; by hand for GPTQ, FP8 and
MXFP4). Streams shard by shard (sharded input keeps its shard files), so the bench presets
of several GiB fit in memory. Weights quantized: every 2-D `.weight` of the decoder layers
but the router (MXFP4: routed experts only, fused per layer as gpt-oss stores them; a gpt-oss
source's fused `gate_up_proj` [E, H, 2I] / `down_proj` [E, I, H], multiplied x @ W, are
quantized as their [out, in] transposes, gate and up rows left interleaved).

    python bench/quantize_checkpoint.py SRC_DIR OUT_DIR --format ct-int4 [--group-size 128]
    python bench/quantize_checkpoint.py SRC_DIR OUT_DIR --format fp8-block --oracle ORACLE_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

# name -> (quantization_config, which weights: "linear" = every 2-D weight of the decoder layers
# but the router, "experts" = routed experts only)
FORMATS: dict[str, dict] = {
    "fp8-block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]},
    "ct-int4": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 8}}}},
    "ct-int4-asym": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                     "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                         "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 16}}}},
    "ct-int8-channel": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                            "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}}},
    "ct-fp8": {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
               "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                   "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}}}},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False, "sym": True,
             "checkpoint_format": "gptq"},
    "gptq-desc-act": {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": True, "sym": True,
                      "checkpoint_format": "gptq"},
    "mxfp4": {"quant_method": "mxfp4"},
}

FP8_MAX = 448.0
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _quantized(name: str, t: torch.Tensor, fmt: str) -> bool:
    if t.dim() != 2 or not name.endswith(".weight") or ".layers." not in name:
        return False
    if name.endswith("mlp.gate.weight"):  # the router stays in float
        return False
    return _is_expert(name) or fmt != "mxfp4"


def fp8_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """FP8 e4m3 with one float32 scale per block (partial blocks at the edges)."""
    out, inp = w.shape
    br, bc = block
    nr, nc = -(-out // br), -(-inp // bc)
    padded = torch.nn.functional.pad(w, (0, nc * bc - inp, 0, nr * br - out)).reshape(nr, br, nc, bc)
    scale = padded.abs().amax(dim=(1, 3)).clamp(min=1e-8) / FP8_MAX  # [nr, nc]
    full = scale.repeat_interleave(br, 0)[:out].repeat_interleave(bc, 1)[:, :inp]  # [out, in]
    q = (w / full).to(torch.float8_e4m3fn)
    return {".weight": q, ".weight_scale_inv": scale}, q.float() * full


def int_groups(w: torch.Tensor, bits: int, group: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Signed codes q [out, in] int8 in [-2^(b-1), 2^(b-1) - 1], scales [out, G] bf16 and
    zero points [out, G] int8 (0 when symmetric), G groups of `group` columns (group = in:
    per channel; the last group may be partial). W = (q - zp) * scale."""
    out, inp = w.shape
    lo_q, hi_q = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    groups = -(-inp // group)
    g = torch.nn.functional.pad(w, (0, groups * group - inp)).reshape(out, groups, group)
    if symmetric:
        scale = (g.abs().amax(-1) / hi_q).clamp(min=1e-8).bfloat16()
        zp = torch.zeros(scale.shape, dtype=torch.int8)
    else:
        mn, mx = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((mx - mn) / (hi_q - lo_q)).clamp(min=1e-8).bfloat16()
        zp = torch.round(lo_q - mn / scale.float()).clamp(lo_q, hi_q).to(torch.int8)
    q = torch.round(g / scale.float()[..., None] + zp[..., None].float()).clamp(lo_q, hi_q).to(torch.int8)
    return q.reshape(out, groups * group)[:, :inp].contiguous(), scale, zp


def compressed_tensors(w: torch.Tensor, weights: dict, fmt: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out, inp = w.shape
    if weights["type"] == "float":  # FP8 with a float32 scale per output channel
        scale = (w.abs().amax(1, keepdim=True).clamp(min=1e-8) / FP8_MAX)
        q = (w / scale).to(torch.float8_e4m3fn)
        return {".weight": q, ".weight_scale": scale}, q.float() * scale
    bits, group = weights["num_bits"], weights.get("group_size") or inp
    q, scale, zp = int_groups(w, bits, group, weights["symmetric"])
    expand = lambda t: t.float().repeat_interleave(group, 1)[:, :inp]  # noqa: E731  [out, in]
    deq = (q.float() - expand(zp)) * expand(scale)
    parts = {".weight_packed": pack_to_int32(q, bits), ".weight_scale": scale,
             ".weight_shape": torch.tensor([out, inp], dtype=torch.int64)}
    if not weights["symmetric"]:
        parts[".weight_zero_point"] = pack_to_int32(zp, bits, packed_dim=0)
    return parts, deq


def _pack_rows(v: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ packing along dim 0: v [n, m] unsigned codes -> int32 [n * bits / 32, m], value
    (i, j) in bits (i % p) * bits of row i // p."""
    p = 32 // bits
    v = v.to(torch.int64).reshape(-1, p, v.shape[1])
    packed = sum(v[:, k] << (k * bits) for k in range(p))  # [n / p, m] in 0 .. 2^32 - 1
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def gptq(w: torch.Tensor, cfg: dict, generator: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """GPTQ v1 (zeros stored minus one), symmetric: codes 0..2^b - 1 around zero 2^(b-1)."""
    out, inp = w.shape
    bits, group = cfg["bits"], cfg["group_size"]
    if cfg["desc_act"]:  # groups follow a random column order (act-order)
        rank = torch.empty(inp, dtype=torch.int64)
        rank[torch.randperm(inp, generator=generator)] = torch.arange(inp)
        g_idx = (rank // group).to(torch.int32)
    else:
        g_idx = (torch.arange(inp) // group).to(torch.int32)
    groups = -(-inp // group)
    mid, top = 1 << (bits - 1), (1 << bits) - 1
    amax = torch.zeros(groups, out).scatter_reduce_(0, g_idx.long()[:, None].expand(inp, out), w.abs().t(), "amax")
    scale = (amax.clamp(min=1e-8) / (mid - 1)).half()  # [G, out]
    s = scale.float()[g_idx.long()]  # [in, out]
    q = torch.round(w.t() / s + mid).clamp(0, top).to(torch.int64)  # [in, out]
    deq = ((q - mid).float() * s).t()
    zeros = torch.full((groups, out), mid - 1, dtype=torch.int64)  # v1: zero minus one
    qzeros = _pack_rows(zeros.t(), bits).t().contiguous()  # packed along the output dim
    return {".qweight": _pack_rows(q, bits), ".qzeros": qzeros, ".scales": scale, ".g_idx": g_idx}, deq


def mxfp4(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """OCP MXFP4: blocks of 32 input columns, an e8m0 exponent each, e2m1 codes (low nibble first)."""
    out, inp = w.shape
    blk = w.reshape(out, inp // 32, 32)
    amax = blk.abs().amax(-1).clamp(min=2.0**-100)
    exp = torch.floor(torch.log2(amax)) - 2  # 6 = 1.5 * 2^2 is e2m1's largest value
    scaled = blk / torch.exp2(exp)[..., None]
    codes = (scaled[..., None] - FP4_VALUES).abs().argmin(-1)  # [out, in/32, 32] nearest e2m1 value
    deq = (FP4_VALUES[codes] * torch.exp2(exp)[..., None]).reshape(out, inp)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # [out, in/32, 16]
    return {"_blocks": packed, "_scales": (exp + 127).to(torch.uint8)}, deq


def quantize_tensor(name: str, w: torch.Tensor, fmt: str, cfg: dict,
                    generator: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One weight [out, in] -> ({suffix: stored tensor}, its exact dequantization float32)."""
    if fmt == "fp8-block":
        return fp8_block(w, tuple(cfg["weight_block_size"]))
    if fmt.startswith("ct-"):
        return compressed_tensors(w, cfg["config_groups"]["group_0"]["weights"], cfg["format"])
    if fmt.startswith("gptq"):
        return gptq(w, cfg, generator)
    return mxfp4(w)


def format_config(fmt: str, group_size: int | None = None) -> dict:
    """The `quantization_config` of `fmt`, with its group size (FP8: block size) replaced when given."""
    cfg = json.loads(json.dumps(FORMATS[fmt]))
    if group_size is not None:
        if fmt == "fp8-block":
            cfg["weight_block_size"] = [group_size, group_size]
        elif fmt.startswith("gptq"):
            cfg["group_size"] = group_size
        elif fmt.startswith("ct-") and cfg["config_groups"]["group_0"]["weights"].get("group_size"):
            cfg["config_groups"]["group_0"]["weights"]["group_size"] = group_size
    return cfg


def quantize_checkpoint(src: str, dst: str, oracle: str | None, fmt: str, seed: int = 0,
                        group_size: int | None = None) -> dict:
    """Write `dst` (the `fmt` checkpoint) and, when `oracle` is given, its exact
    dequantization (float32, in `src`'s layout) from the float checkpoint `src`.
    Returns {"stored_bytes": ..., "source_bytes": ...}."""
    cfg = format_config(fmt, group_size)
    generator = torch.Generator().manual_seed(seed)
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:  # every file, as moestream reads a directory without an index (e.g. model + mtp.safetensors)
        files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    for d in [dst] + ([oracle] if oracle else []):
        os.makedirs(d, exist_ok=True)
        for f in os.listdir(src):
            if not f.endswith(".safetensors") and f != "model.safetensors.index.json" and os.path.isfile(
                    os.path.join(src, f)):
                shutil.copy(os.path.join(src, f), d)
    weight_map: dict[str, str] = {}
    oracle_map: dict[str, str] = {}
    pending: dict[str, dict[int, dict[str, dict[str, torch.Tensor]]]] = {}  # mxfp4: layer prefix -> e -> matrix -> parts
    stored_bytes = source_bytes = 0
    num_experts = None
    for fname in files:
        tensors = load_file(os.path.join(src, fname))
        stored: dict[str, torch.Tensor] = {}
        deq_all: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            source_bytes += t.numel() * t.element_size()
            if fmt == "mxfp4" and t.dim() == 3 and name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
                # gpt-oss's fused experts, stored x @ W ([E, in, out]): MXFP4 keeps [E, out, in] as gpt-oss does
                quant = [mxfp4(w.float().t()) for w in t]
                for suffix in ("_blocks", "_scales"):
                    stored[name + suffix] = torch.stack([q[0][suffix] for q in quant]).contiguous()
                if oracle:
                    deq_all[name] = torch.stack([q[1].t() for q in quant])
                continue
            if not _quantized(name, t, fmt):
                stored[name] = t
                continue
            parts, deq = quantize_tensor(name, t.float(), fmt, cfg, generator)
            if oracle:
                deq_all[name] = deq
            base = name.removesuffix(".weight")
            if fmt != "mxfp4":
                stored.update({base + s: v.contiguous() for s, v in parts.items()})
                continue
            prefix, rest = base.split(".mlp.experts.")
            e, matrix = rest.split(".")
            pending.setdefault(prefix, {}).setdefault(int(e), {})[matrix] = parts
        if fmt == "mxfp4":  # a layer's fused tensors go out with the shard that completes it
            num_experts = num_experts or _num_experts(src)
            for prefix in [p for p, per in pending.items()
                           if len(per) == num_experts and all(len(m) == 3 for m in per.values())]:
                per = [pending[prefix][e] for e in range(num_experts)]
                for suffix in ("_blocks", "_scales"):
                    stored[f"{prefix}.mlp.experts.gate_up_proj{suffix}"] = torch.stack(
                        [torch.cat((p["gate_proj"][suffix], p["up_proj"][suffix])) for p in per]).contiguous()
                    stored[f"{prefix}.mlp.experts.down_proj{suffix}"] = torch.stack(
                        [p["down_proj"][suffix] for p in per]).contiguous()
                del pending[prefix]
        save_file(stored, os.path.join(dst, fname), metadata={"format": "pt"})
        stored_bytes += sum(t.numel() * t.element_size() for t in stored.values())
        weight_map.update({n: fname for n in stored})
        if oracle:
            out = {n: deq_all.get(n, t).float().contiguous() for n, t in tensors.items()}
            save_file(out, os.path.join(oracle, fname), metadata={"format": "pt"})
            oracle_map.update({n: fname for n in out})
        del tensors, stored, deq_all
    if pending:
        raise ValueError(f"experts of {sorted(pending)} are incomplete in '{src}'")
    if os.path.isfile(index):
        for d, m in [(dst, weight_map)] + ([(oracle, oracle_map)] if oracle else []):
            with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {}, "weight_map": m}, f, indent=2)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": cfg}, f, indent=2)
    if oracle:
        with open(os.path.join(oracle, "config.json"), "w") as f:
            json.dump({**config, "torch_dtype": "float32", "dtype": "float32"}, f, indent=2)
    return {"stored_bytes": stored_bytes, "source_bytes": source_bytes}


def _num_experts(src: str) -> int:
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    return cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg["num_local_experts"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", help="float checkpoint directory (single file or sharded)")
    ap.add_argument("dst", help="directory for the quantized checkpoint")
    ap.add_argument("--format", choices=sorted(FORMATS), required=True)
    ap.add_argument("--oracle", help="also write the exact float32 dequantization here")
    ap.add_argument("--group-size", type=int, help="group size of the int formats, block size of fp8-block (default: the format's)")
    args = ap.parse_args()
    print(quantize_checkpoint(args.src, args.dst, args.oracle, args.format, group_size=args.group_size))
