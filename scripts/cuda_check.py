"""Device check of moestream's CUDA code paths, in one short prepared run.

Run from the repository root (moestream need not be installed; the server, and so
fastapi / uvicorn / pydantic / prometheus-client, is never imported):

    PYTHONPATH=. python3 scripts/cuda_check.py --out OUT_DIR                    # GPU machine: device cuda
    PYTHONPATH=. python3 scripts/cuda_check.py --device cpu --threads 1 --out /tmp/cc   # the same checks on the CPU

It builds tiny random checkpoints (tests/tiny_checkpoint.py: qwen3_moe, mixtral, qwen3_next,
qwen3_5_moe) in a temporary directory and checks, on the device, in float32 greedy unless said:

- env: versions, the device, TF32 off (an fp32 matmul checked against float64), and that
  importing moestream pulled in no server module.
- dense models (qwen3_moe, mixtral; 8 prompts of 1..40 tokens decoded together, 24 tokens):
  every tensor on the device; tokens and logits vs the same engine on the CPU and vs HF
  transformers (float32, eager experts) on the device.
- expert paging on the device: few slots (batches run in waves), a host cache (pinned on
  CUDA), prefetch gate / history / none (gate and history run the prefetch thread while the
  main thread computes): token ids identical to the fully resident run (logits bit-exactness
  recorded), expert stats recorded.
- hybrid models (qwen3_next, qwen3_5_moe): max_resident_states=2 for 8 running requests
  (states swapped to pinned host memory and back every step) vs the default; vs the CPU
  engine; vs HF; and paged experts with gate prefetch on top of the swapping (bit-exact).
- bf16 on the device (runs, tokens recorded; no equality asserted); the sampler on the device
  (seeded sampling with penalties, top-k/p, min-p and logprobs reproduces itself); decode
  throughput at 16 concurrent requests (recorded only).

Token comparisons allow only a numerical tie at the first divergence: the reference's top-2
logit gap must be within twice the logit difference seen there. Logits must agree within
--atol (1e-3) up to the divergence.

Output: OUT_DIR/cuda_check.json (rewritten after every check, so a killed run keeps what it
did) and a summary on stdout. Exit status 1 if any check failed; skipped checks (not
applicable here, a failed prerequisite, or the --time-limit reached) do not fail. On the
CPU the "vs CPU" comparisons are skipped as trivial. A run that hangs past --time-limit +
30 s dumps every thread's stack to stderr and exits 1.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local checkpoints only; the GPU machine has no network

import torch  # noqa: E402
from parity import TIE_GAP, LogitsRecorder, greedy_params  # noqa: E402
from tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

import moestream  # noqa: E402
from moestream.models.hf_config import model_config_from_hf  # noqa: E402
from moestream import LLM, EngineConfig, SamplingParams  # noqa: E402
from moestream.experts.store import PagedExpertStore  # noqa: E402

PROMPT_LENGTHS = (1, 3, 7, 12, 18, 25, 33, 40)  # as tests/conftest.py
MAX_TOKENS = 24
MAX_MODEL_LEN = 128
MIXTRAL_SLIDING_WINDOW = 24  # shorter than prompt + output, as tests/conftest.py
DENSE = ("qwen3_moe", "mixtral")
HYBRID = ("qwen3_next", "qwen3_5_moe")
SEEDS = {"qwen3_moe": 0, "mixtral": 1, "qwen3_next": 2, "qwen3_5_moe": 3}
SERVER_MODULES = ("fastapi", "uvicorn", "starlette", "prometheus_client", "moestream.server")


class Skip(Exception):
    """A check that does not apply here (the message says why)."""


class CheckFailed(AssertionError):
    """A check's condition did not hold."""


def expect(cond: bool, msg: str) -> None:
    if not cond:
        raise CheckFailed(msg)


@dataclass
class Record:
    """One check's outcome: status pass / fail / skip, numbers in `data`, non-fatal `warnings`."""

    name: str
    status: str = "pending"
    seconds: float = 0.0
    summary: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    error: str | None = None
    traceback: str | None = None

    def warn(self, msg: str) -> None:
        self.warnings.append(msg)


@dataclass
class Run:
    """Greedy results of one engine or HF run: token ids per prompt and logits [n, V] per prompt."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]
    seconds: float


class Checker:
    """Runs checks one by one, records them, and rewrites the JSON after each."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.on_cuda = self.device.type == "cuda"
        self.started = time.monotonic()
        self.records: list[Record] = []
        self.env: dict[str, Any] = {}
        self.broken: str | None = None  # set when the device is unusable: later checks are skipped
        self.dirs: dict[str, str] = {}
        self.runs: dict[str, Run] = {}
        self.current: str | None = None  # the check running now (in the JSON, so a killed run shows where)
        os.makedirs(args.out, exist_ok=True)
        self.path = os.path.join(args.out, "cuda_check.json")

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def status(self, name: str) -> str | None:
        return next((r.status for r in self.records if r.name == name), None)

    def wanted(self, name: str) -> bool:
        return not self.args.only or any(s in name for s in self.args.only)

    def check(self, name: str, fn: Callable[[Record], Any], needs: Sequence[str] = ()) -> Any:
        """Run `fn(record)` as check `name` unless a prerequisite in `needs` did not pass;
        returns fn's value (None when it failed or was skipped)."""
        if not self.wanted(name):
            return None
        rec = Record(name)
        value = None
        missing = [n for n in needs if self.status(n) != "pass"]
        t0 = time.perf_counter()
        if self.broken:
            rec.status, rec.summary = "skip", f"device unusable: {self.broken}"
        elif missing:
            rec.status, rec.summary = "skip", f"needs {', '.join(missing)} (did not pass)"
        elif self.elapsed() > self.args.time_limit:
            rec.status, rec.summary = "skip", f"time limit {self.args.time_limit:.0f} s reached"
        else:
            self.current = name
            self.write()
            try:
                if self.on_cuda and torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats(self.device)
                value = fn(rec)
                self.sync()  # an asynchronous CUDA error surfaces here, in the check that caused it
                rec.status = "pass"
            except Skip as e:
                rec.status, rec.summary = "skip", str(e)
            except Exception as e:  # noqa: BLE001 - every failure is recorded, none stops the run
                rec.status, rec.error = "fail", f"{type(e).__name__}: {e}"
                rec.traceback = traceback.format_exc()[-6000:]
                self._probe_device()
            if self.on_cuda and rec.status != "skip" and not self.broken:
                try:
                    rec.data["peak_device_mib"] = round(torch.cuda.max_memory_allocated(self.device) / 2**20, 1)
                except Exception:  # noqa: BLE001
                    pass
        rec.seconds = round(time.perf_counter() - t0, 3)
        self.current = None
        self.records.append(rec)
        gc.collect()
        if self.on_cuda and not self.broken:
            torch.cuda.empty_cache()
        self.write()
        line = f"[{self.elapsed():6.1f}s] {rec.status.upper():4} {name} ({rec.seconds:.1f}s)"
        if rec.summary:
            line += f": {rec.summary}"
        if rec.error:
            line += f"\n        {rec.error[:500]}"
        for w in rec.warnings:
            line += f"\n        warning: {w[:300]}"
        print(line, flush=True)
        return value

    def sync(self) -> None:
        if self.on_cuda:
            torch.cuda.synchronize(self.device)

    def _probe_device(self) -> None:
        """After a failure on CUDA: is the context still usable (a device-side assert is sticky)?"""
        if not self.on_cuda or self.broken:
            return
        try:
            torch.ones(4, device=self.device).sum().item()
            torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001
            self.broken = f"{type(e).__name__}: {e}"[:300]

    def document(self, complete: bool) -> dict[str, Any]:
        counts = {s: sum(r.status == s for r in self.records) for s in ("pass", "fail", "skip")}
        return {
            "script": "scripts/cuda_check.py",
            "argv": sys.argv[1:],
            "device": str(self.device),
            "complete": complete,
            "running": self.current,
            "seconds": round(self.elapsed(), 1),
            "counts": counts,
            "env": self.env,
            "checks": [r.__dict__ for r in self.records],
        }

    def write(self, complete: bool = False) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.document(complete), f, indent=1, default=str)
        os.replace(tmp, self.path)


# ---- helpers ------------------------------------------------------------------------


def parity_prompts(vocab_limit: int, seed: int = 1234) -> list[list[int]]:
    """8 prompts of random token ids, lengths 1..40 (tests/conftest.py's)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_limit) for _ in range(n)] for n in PROMPT_LENGTHS]


def prompts_for(model_dir: str) -> list[list[int]]:
    return parity_prompts(min(30000, model_config_from_hf(model_dir).vocab_size - 1))


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> Run:
    """Greedy generation of all prompts together, recording the raw logits of every sampled position."""
    recs = [LogitsRecorder() for _ in prompts]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy_params(r, max_tokens) for r in recs])
    if llm.llm_engine.device.type == "cuda":
        torch.cuda.synchronize(llm.llm_engine.device)
    seconds = time.perf_counter() - t0
    vocab = llm.llm_engine.model_config.vocab_size
    logits = [torch.stack(r.logits) if r.logits else torch.empty(0, vocab) for r in recs]
    return Run([o.outputs[0].token_ids for o in outs], logits, round(seconds, 3))


def compare(ours: Run, ref: Run, atol: float) -> dict[str, Any]:
    """Tokens and logits of `ours` against `ref`, prompt by prompt.

    Logits are compared up to and including the first differing token; a differing token is
    a tie (allowed) only when ref's top-2 gap there is within twice the logit difference
    there (plus parity.TIE_GAP), i.e. when the difference seen can explain the flip.
    """
    max_diff, ties, problems = 0.0, [], []
    for i, (ta, la, tb, lb) in enumerate(zip(ours.tokens, ours.logits, ref.tokens, ref.logits)):
        n = min(len(ta), len(tb))
        diverge = next((j for j in range(n) if ta[j] != tb[j]), None)
        upto = n if diverge is None else diverge + 1
        if upto:
            a, b = la[:upto].float(), lb[:upto].to(la.device).float()
            per_pos = (a - b).abs().amax(dim=-1).cpu()  # [upto]
            d = per_pos.max().item()
            max_diff = max(max_diff, d)
            if d >= atol:
                problems.append(f"prompt {i}: logits differ by {d:.3g} (atol {atol:g}) at position {int(per_pos.argmax())}")
        if diverge is None:
            if len(ta) != len(tb):
                problems.append(f"prompt {i}: {len(ta)} tokens, reference {len(tb)}")
            continue
        top2 = lb[diverge].float().topk(2).values
        gap = (top2[0] - top2[1]).item()
        allowed = 2 * per_pos[diverge].item() + TIE_GAP
        msg = f"prompt {i} position {diverge}: {ta[diverge]} vs reference {tb[diverge]}, top-2 gap {gap:.3g}"
        if gap <= allowed:
            ties.append(msg + f" <= {allowed:.3g} (tie)")
        else:
            problems.append(msg + f" > {allowed:.3g}: not a tie")
    return {
        "tokens_identical": ours.tokens == ref.tokens,
        "max_logit_diff": max_diff,
        "ties": ties,
        "problems": problems,
        "num_tokens": sum(len(t) for t in ours.tokens),
    }


def expect_match(rec: Record, key: str, cmp: dict[str, Any]) -> None:
    rec.data[key] = cmp
    if cmp["ties"]:
        rec.warn(f"{key}: {len(cmp['ties'])} numerical tie(s): {cmp['ties'][0]}")
    expect(not cmp["problems"], f"{key}: " + "; ".join(cmp["problems"][:3]))


def bit_exact(a: Run, b: Run) -> bool:
    return a.tokens == b.tokens and all(torch.equal(x, y.to(x.device)) for x, y in zip(a.logits, b.logits))


def off_device(llm: LLM, device: torch.device) -> list[str]:
    """Names of engine tensors that are not on `device` (model, KV cache, experts, states, sampler)."""
    eng = llm.llm_engine
    want = device.type
    bad = [f"param {n} on {p.device}" for n, p in eng.runner.model.named_parameters() if p.device.type != want]
    for i, (k, v) in enumerate(eng.runner.kv_caches):
        bad += [f"kv_caches[{i}] on {t.device}" for t in (k, v) if t.device.type != want]
    store = eng.expert_store
    for name in ("gate_up", "down"):  # PagedExpertStore slots
        t = getattr(store, name, None)
        if isinstance(t, torch.Tensor) and t.device.type != want:
            bad.append(f"expert slots {name} on {t.device}")
    for name in ("_gate_up", "_down"):  # ResidentExpertStore per-layer stacks
        for layer, t in (getattr(store, name, None) or {}).items():
            if t.device.type != want:
                bad.append(f"resident experts {name}[{layer}] on {t.device}")
    for mname, m in eng.runner.model.named_modules():
        t = getattr(m, "inv_freq", None)
        if isinstance(t, torch.Tensor) and t.device.type != want:
            bad.append(f"{mname}.inv_freq on {t.device}")
    pool = eng.state_pool
    if pool is not None:
        bad += [f"state pool tensor on {t.device}" for t in [*pool.conv, *pool.ssm] if t.device.type != want]
    if eng.sampler.generator.device.type != want:
        bad.append(f"sampler generator on {eng.sampler.generator.device}")
    return bad


def expert_bytes(model_dir: str, elem: int = 4) -> int:
    cfg = model_config_from_hf(model_dir)
    return 3 * cfg.moe_intermediate_size * cfg.hidden_size * elem


def paged_kwargs(model_dir: str, prefetch: str, elem: int = 4) -> dict[str, Any]:
    """Engine arguments for paged experts with a host cache that holds them all.

    Device slots: with prefetch "gate", 1.5 layers' worth, so that the router lookahead has
    free slots to load into while a batch's layer runs (when a wave fills every slot, the
    gate's hints find none); otherwise half a layer's experts, so that a batch runs each
    layer in waves.
    """
    cfg = model_config_from_hf(model_dir)
    eb = expert_bytes(model_dir, elem)
    slots = cfg.num_experts * 3 // 2 if prefetch == "gate" else max(cfg.num_experts // 2, cfg.num_experts_per_tok)
    total = sum(cfg.moe_layers) * cfg.num_experts
    return dict(expert_budget=slots * eb, expert_host_cache_bytes=total * eb, expert_prefetch=prefetch)


def stats_summary(stats: dict[str, Any]) -> dict[str, Any]:
    keys = ("hit_rate", "hits", "misses", "evictions", "stall_seconds", "prefetch_loads", "prefetch_hits",
            "wasted_prefetch_bytes", "bytes_read_per_tier", "num_slots", "host_cache_experts", "prefetch", "policy")
    return {k: stats.get(k) for k in keys}


def host_cache_pinned(store: PagedExpertStore) -> list[bool]:
    """Whether each host-cache entry's buffers are page-locked (private state, read for this check)."""
    return [bool(w.gate_up.is_pinned() and w.down.is_pinned()) for w in store._host._entries.values()]


# ---- checks -------------------------------------------------------------------------


def check_env(ck: Checker, rec: Record) -> None:
    import transformers

    env = ck.env
    env.update(
        python=platform.python_version(), torch=torch.__version__, torch_cuda=torch.version.cuda,
        transformers=transformers.__version__, moestream=moestream.__version__, moestream_path=moestream.__file__,
        cuda_available=torch.cuda.is_available(), threads=torch.get_num_threads(), hostname=platform.node(),
    )
    try:
        env["git_head"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                                         timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001 - a copy of the tree without git is fine
        env["git_head"] = None
    loaded = sorted(m for m in sys.modules if any(m == s or m.startswith(s + ".") for s in SERVER_MODULES))
    env["server_modules_loaded"] = loaded
    expect(not loaded, f"importing moestream pulled in server modules: {loaded}")
    if not os.path.realpath(moestream.__file__).startswith(os.path.realpath(ROOT)):
        rec.warn(f"moestream imported from {moestream.__file__}, not from this tree {ROOT}")
    if ck.on_cuda:
        if not torch.cuda.is_available():
            ck.broken = "CUDA was asked for but torch sees no CUDA device"
            raise CheckFailed(ck.broken)
        props = torch.cuda.get_device_properties(ck.device)
        env.update(device_name=props.name, capability=list(torch.cuda.get_device_capability(ck.device)),
                   device_mib=props.total_memory // 2**20, bf16_supported=torch.cuda.is_bf16_supported())
    env["fp32_precision"] = precision_flags()
    # TF32 would round fp32 matmul inputs to 10 mantissa bits (relative error ~1e-3); full fp32 gives ~1e-6.
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(512, 512, generator=gen, dtype=torch.float64) for _ in range(2))
    exact = a @ b
    got = (a.float().to(ck.device) @ b.float().to(ck.device)).double().cpu()
    rel = ((got - exact).abs().max() / exact.abs().max()).item()
    rec.data["fp32_matmul_rel_error"] = rel
    expect(rel < 1e-4, f"fp32 matmul relative error {rel:.2e}: TF32 (or another reduced precision) is still on")
    rec.summary = f"{env.get('device_name', 'cpu')}, torch {torch.__version__}, fp32 matmul rel err {rel:.1e}"


def disable_tf32() -> None:
    """Full-precision float32 matmuls and convolutions (HF parity needs them), with the new
    fp32_precision API where torch has it (mixing it with the legacy allow_tf32 flags raises)."""
    if hasattr(torch.backends, "fp32_precision"):
        torch.backends.fp32_precision = "ieee"
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        for backend in (torch.backends.cudnn.conv, torch.backends.cudnn.rnn):
            try:
                backend.fp32_precision = "ieee"
            except Exception:  # noqa: BLE001
                pass
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")


def precision_flags() -> dict[str, Any]:
    """The float32 precision settings as torch reports them (recorded; the matmul check decides)."""
    try:
        out: dict[str, Any] = {"matmul_precision": torch.get_float32_matmul_precision()}
        if hasattr(torch.backends, "fp32_precision"):
            out.update(backends=torch.backends.fp32_precision, cuda_matmul=torch.backends.cuda.matmul.fp32_precision,
                       cudnn_conv=torch.backends.cudnn.conv.fp32_precision)
        else:
            out.update(cuda_matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                       cudnn_allow_tf32=torch.backends.cudnn.allow_tf32)
        return out
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


def check_checkpoint(ck: Checker, rec: Record, mt: str) -> None:
    """A tiny random checkpoint of model type `mt` (seeds and Mixtral's window as tests/conftest.py)."""
    if "workdir" not in ck.env:
        ck.env["workdir"] = ck.args.workdir or tempfile.mkdtemp(prefix="moestream-cuda-check-")
    extra = {"sliding_window": MIXTRAL_SLIDING_WINDOW} if mt == "mixtral" else {}
    d = make_tiny_checkpoint(os.path.join(ck.env["workdir"], mt), mt, seed=SEEDS[mt], **extra)
    cfg = model_config_from_hf(d)
    ck.dirs[mt] = d
    rec.data.update(path=d, moe_layers=sum(cfg.moe_layers), num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                    expert_bytes_fp32=expert_bytes(d), layer_types=list(cfg.layer_types))
    rec.summary = f"{mt}: {sum(cfg.moe_layers)} MoE layers x {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}"


def check_auto_prefetch(ck: Checker, rec: Record) -> None:
    got = EngineConfig(model=ck.dirs["qwen3_moe"], device=str(ck.device)).resolved_expert_prefetch
    want = "gate" if ck.on_cuda else "none"
    rec.data.update(resolved=got, expected=want)
    expect(got == want, f"expert_prefetch='auto' on {ck.device} resolved to {got!r}, expected {want!r}")
    rec.summary = f"auto -> {got}"


def check_device_greedy(ck: Checker, rec: Record, mt: str, **kw: Any) -> None:
    """Greedy on the device; every engine tensor there. Keeps the run for later comparisons."""
    d = ck.dirs[mt]
    llm = LLM(d, dtype="float32", device=str(ck.device), max_model_len=MAX_MODEL_LEN, **kw)
    bad = off_device(llm, ck.device)
    expect(not bad, f"{len(bad)} tensors off {ck.device}: {bad[:5]}")
    run = greedy(llm, prompts_for(d))
    ck.runs[mt] = run
    rec.data.update(seconds_generate=run.seconds, num_tokens=sum(map(len, run.tokens)),
                    tokens_per_prompt=[len(t) for t in run.tokens])
    expect(all(len(t) > 0 for t in run.tokens), "a prompt produced no token")
    rec.summary = f"{sum(map(len, run.tokens))} tokens in {run.seconds:.2f}s, all tensors on {ck.device.type}"


def check_vs_cpu(ck: Checker, rec: Record, mt: str) -> None:
    if not ck.on_cuda:
        raise Skip("device is the CPU: the comparison with the CPU engine is trivial")
    d = ck.dirs[mt]
    cpu = greedy(LLM(d, dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN), prompts_for(d))
    cmp = compare(ck.runs[mt], cpu, ck.args.atol)
    expect_match(rec, "device_vs_cpu", cmp)
    rec.summary = f"tokens identical: {cmp['tokens_identical']}, max logit diff {cmp['max_logit_diff']:.2e}"


def hf_greedy(model_dir: str, prompts: list[list[int]], device: torch.device,
              max_tokens: int = MAX_TOKENS) -> tuple[Run, str]:
    """HF transformers float32 greedy, one prompt at a time, with its experts in the eager
    per-expert loop (grouped_mm kernels may not run float32 at full precision)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager")
        impl = "eager"
    except Exception as e:  # noqa: BLE001 - a transformers without the option: its default
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        impl = f"default ({type(e).__name__})"
    model.to(device).eval()
    tokens, logits = [], []
    t0 = time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        tokens.append(out.sequences[0, len(p):].tolist())
        logits.append(torch.stack([x[0] for x in out.logits]).float())
    return Run(tokens, logits, round(time.perf_counter() - t0, 3)), impl


def check_hf_parity(ck: Checker, rec: Record, mt: str) -> None:
    d = ck.dirs[mt]
    ref, impl = hf_greedy(d, prompts_for(d), ck.device)
    rec.data.update(hf_experts_implementation=impl, hf_seconds=ref.seconds)
    cmp = compare(ck.runs[mt], ref, ck.args.atol)
    expect_match(rec, "engine_vs_hf", cmp)
    rec.summary = f"tokens identical: {cmp['tokens_identical']}, max logit diff {cmp['max_logit_diff']:.2e} (HF on {ck.device.type})"


def check_paging(ck: Checker, rec: Record, mt: str, prefetch: str) -> None:
    """A few device slots + a host cache: token ids identical to the fully resident run."""
    d = ck.dirs[mt]
    llm = LLM(d, dtype="float32", device=str(ck.device), max_model_len=MAX_MODEL_LEN, **paged_kwargs(d, prefetch))
    store = llm.llm_engine.expert_store
    expect(isinstance(store, PagedExpertStore), f"expected a PagedExpertStore, got {type(store).__name__}")
    expect(not off_device(llm, ck.device), f"tensors off {ck.device}: {off_device(llm, ck.device)[:5]}")
    expect(store._host._pin == ck.on_cuda, f"host cache pin={store._host._pin} on {ck.device.type}")
    thread = store._thread
    rec.data.update(prefetch_thread=thread is not None, slots=store.num_slots,
                    max_experts_per_call=store.max_experts_per_call(),
                    waves=store.max_experts_per_call() < llm.llm_engine.model_config.num_experts)
    expect((thread is not None) == (prefetch != "none"), f"prefetch thread {thread} with prefetch={prefetch}")
    run = greedy(llm, prompts_for(d))
    stats = llm.expert_stats()
    rec.data.update(seconds_generate=run.seconds, stats=stats_summary(stats),
                    prefetch_thread_alive=bool(thread and thread.is_alive()))
    pinned = host_cache_pinned(store)
    rec.data["host_cache_entries"] = len(pinned)
    rec.data["host_cache_all_pinned"] = all(pinned) if pinned else None
    base = ck.runs[mt]
    rec.data["tokens_identical"] = run.tokens == base.tokens
    rec.data["logits_bit_exact"] = exact = bit_exact(run, base)
    expect(stats["misses"] > 0, "no expert miss: the budget did not force paging")
    if prefetch == "none":  # prefetches read disk -> slot and bypass the host cache; demand misses go through it
        expect(stats["bytes_read_per_tier"]["host"] > 0, "the host cache served nothing")
    elif not stats["bytes_read_per_tier"]["host"]:
        rec.warn("the host cache served nothing")
    if ck.on_cuda:
        expect(bool(pinned) and all(pinned), f"host cache buffers not all pinned on CUDA: {pinned}")
    expect(run.tokens == base.tokens, f"paged ({prefetch}) tokens differ from the resident run: "
           f"{first_difference(run.tokens, base.tokens)}")
    if not exact:
        rec.warn("token ids identical but logits not bit-exact vs the resident run "
                 f"(max diff {compare(run, base, 1.0)['max_logit_diff']:.2e})")
    if prefetch != "none" and not stats["prefetch_loads"]:
        rec.warn(f"prefetch={prefetch} loaded nothing ahead")
    rec.summary = (f"identical, hit rate {stats['hit_rate']:.3f}, misses {stats['misses']}, prefetch loads "
                   f"{stats['prefetch_loads']} (hits {stats['prefetch_hits']}), stall {stats['stall_seconds']:.3f}s, "
                   f"{run.seconds:.2f}s")


def first_difference(a: list[list[int]], b: list[list[int]]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            j = next((k for k in range(min(len(x), len(y))) if x[k] != y[k]), min(len(x), len(y)))
            return f"prompt {i} position {j}: {x[j:j + 4]} vs {y[j:j + 4]}"
    return "lengths differ" if len(a) != len(b) else "none"


def swap_run(ck: Checker, rec: Record, mt: str, **kw: Any) -> Run:
    """8 requests with 2 device state slots, stepped by hand to watch the pool; returns the run."""
    d = ck.dirs[mt]
    llm = LLM(d, dtype="float32", device=str(ck.device), max_model_len=MAX_MODEL_LEN, max_resident_states=2, **kw)
    engine = llm.llm_engine
    pool = engine.state_pool
    expect(pool is not None and pool.max_resident == 2, "no state pool of 2 slots")
    expect(pool._pin == ck.on_cuda, f"state pool pin={pool._pin} on {ck.device.type}")
    prompts = prompts_for(d)
    recs = [LogitsRecorder() for _ in prompts]
    for i, (p, r) in enumerate(zip(prompts, recs)):
        engine.add_request({"prompt_token_ids": p}, greedy_params(r, MAX_TOKENS), request_id=str(i))
    final: dict[int, list[int]] = {}
    steps, max_resident, host_seen, host_pinned = 0, 0, 0, True
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[int(out.request_id)] = out.outputs[0].token_ids
        steps += 1
        max_resident = max(max_resident, pool.num_resident())
        for tensors in pool._host.values():  # states waiting in host memory (private state, read for this check)
            host_seen += 1
            host_pinned &= all(t.is_pinned() and t.device.type == "cpu" for t in tensors)
    ck.sync()
    seconds = time.perf_counter() - t0
    rec.data["swap"] = dict(steps=steps, swap_outs=pool.num_swap_outs, swap_ins=pool.num_swap_ins,
                            max_resident=max_resident, host_states_seen=host_seen, host_all_pinned=host_pinned,
                            seconds=round(seconds, 3))
    store = engine.expert_store
    if isinstance(store, PagedExpertStore):
        stats = llm.expert_stats()
        rec.data["expert_stats"] = stats_summary(stats)
        expect(stats["misses"] > 0, "no expert miss: the budget did not force paging")
        if ck.on_cuda:
            pinned = host_cache_pinned(store)
            expect(bool(pinned) and all(pinned), f"host cache buffers not all pinned on CUDA: {pinned}")
    expect(max_resident <= 2, f"{max_resident} states resident with 2 slots")
    expect(pool.num_swap_ins > 0 and pool.num_swap_outs > 0, "no state was swapped")
    if ck.on_cuda:
        expect(host_pinned, "a swapped-out state is not in pinned host memory")
    expect(pool.num_resident() == 0 and pool.num_swapped() == 0 and pool.num_free_slots == 2,
           "the state pool is not empty after all requests finished")
    vocab = engine.model_config.vocab_size
    logits = [torch.stack(r.logits) if r.logits else torch.empty(0, vocab) for r in recs]
    return Run([final[i] for i in range(len(prompts))], logits, round(seconds, 3))


def check_state_swap(ck: Checker, rec: Record, mt: str) -> None:
    """2 state slots for 8 requests (swapped to host every step) vs the default slots."""
    run = swap_run(ck, rec, mt)
    ck.runs[mt + "/swap"] = run
    cmp = compare(run, ck.runs[mt], ck.args.atol)  # forwards of 2 rows vs 8: shapes, and so last bits, differ
    expect_match(rec, "swap_vs_default", cmp)
    s = rec.data["swap"]
    rec.summary = (f"{s['swap_ins']} swap-ins / {s['swap_outs']} swap-outs in {s['steps']} steps, tokens identical: "
                   f"{cmp['tokens_identical']}, max logit diff {cmp['max_logit_diff']:.2e}")


def check_hybrid_paging(ck: Checker, rec: Record, mt: str) -> None:
    """Paged experts with gate prefetch on top of 2 swapped state slots: bit-exact vs swapping alone."""
    d = ck.dirs[mt]
    run = swap_run(ck, rec, mt, **paged_kwargs(d, "gate"))
    base = ck.runs[mt + "/swap"]
    rec.data["tokens_identical"] = run.tokens == base.tokens
    rec.data["logits_bit_exact"] = exact = bit_exact(run, base)
    expect(run.tokens == base.tokens, f"tokens differ from the resident swap run: {first_difference(run.tokens, base.tokens)}")
    if not exact:
        rec.warn("token ids identical but logits not bit-exact vs the resident swap run")
    st = rec.data["expert_stats"]
    rec.summary = (f"identical to the resident swap run, logits bit-exact: {exact}; hit rate {st['hit_rate']:.3f}, "
                   f"prefetch loads {st['prefetch_loads']}")


def check_bf16(ck: Checker, rec: Record) -> None:
    """bf16 on the device: runs and produces tokens (agreement with float32 recorded, not asserted)."""
    if ck.on_cuda and not torch.cuda.is_bf16_supported():
        raise Skip("this GPU has no bf16")
    for mt in ("qwen3_moe", "qwen3_next"):
        if mt not in ck.dirs:
            continue
        d = ck.dirs[mt]
        prompts = prompts_for(d)
        llm = LLM(d, dtype="bfloat16", device=str(ck.device), max_model_len=MAX_MODEL_LEN)
        run = greedy(llm, prompts)
        del llm
        paged = greedy(LLM(d, dtype="bfloat16", device=str(ck.device), max_model_len=MAX_MODEL_LEN,
                           **paged_kwargs(d, "gate", elem=2)), prompts)
        entry: dict[str, Any] = dict(seconds=run.seconds, num_tokens=sum(map(len, run.tokens)),
                                     paged_gate_tokens_identical=paged.tokens == run.tokens)
        f32 = ck.runs.get(mt)
        if f32 is not None:
            same = [next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
                    for a, b in zip(run.tokens, f32.tokens)]
            entry["tokens_matching_fp32_before_divergence"] = same
        finite = all(bool(torch.isfinite(x).all()) for x in run.logits)
        entry["logits_finite"] = finite
        rec.data[mt] = entry
        expect(all(len(t) > 0 for t in run.tokens), f"{mt}: a prompt produced no token in bf16")
        expect(finite, f"{mt}: non-finite bf16 logits")
        if not entry["paged_gate_tokens_identical"]:
            rec.warn(f"{mt}: bf16 paged (gate) tokens differ from bf16 resident")
    rec.summary = ", ".join(f"{mt}: {e['num_tokens']} tokens" for mt, e in rec.data.items() if isinstance(e, dict))


def check_sampler(ck: Checker, rec: Record) -> None:
    """Seeded and engine-seeded sampling with every processor on the device reproduces itself."""
    d = ck.dirs["qwen3_moe"]
    prompts = prompts_for(d)
    vocab = model_config_from_hf(d).vocab_size

    def params(i: int) -> SamplingParams:
        common = dict(max_tokens=16, logprobs=3, ignore_eos=True)
        if i % 2:  # the engine's generator (no per-request seed)
            return SamplingParams(temperature=1.0, top_k=50, **common)
        return SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.02, repetition_penalty=1.2,
                              presence_penalty=0.2, frequency_penalty=0.1, seed=100 + i, **common)

    def once() -> list[tuple[list[int], list[float]]]:
        llm = LLM(d, dtype="float32", device=str(ck.device), max_model_len=MAX_MODEL_LEN, seed=7)
        expect(llm.llm_engine.sampler.generator.device.type == ck.device.type, "sampler generator off the device")
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [params(i) for i in range(len(prompts))])
        return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in outs]

    a, b = once(), once()
    tokens = [t for t, _ in a]
    lps = [x for _, lp in a for x in lp]
    rec.data.update(num_tokens=sum(map(len, tokens)), reproducible=a == b, distinct_tokens=len({t for ts in tokens for t in ts}))
    expect(all(len(t) == 16 for t in tokens), f"expected 16 tokens per request, got {[len(t) for t in tokens]}")
    expect(all(0 <= t < vocab for ts in tokens for t in ts), "a sampled token id is outside the vocabulary")
    expect(all(math.isfinite(x) and x <= 1e-6 for x in lps), "a sampled token's logprob is not finite and <= 0")
    expect(a == b, "the same seeds gave different tokens or logprobs on a second run")
    rec.summary = f"{rec.data['num_tokens']} sampled tokens, reproducible"


def check_timing(ck: Checker, rec: Record) -> None:
    """Decode throughput at 16 concurrent requests (recorded, not asserted)."""
    d = ck.dirs["qwen3_moe"]
    n, plen, out_len = ck.args.timing_concurrency, 32, ck.args.timing_tokens
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 30000) for _ in range(plen)] for _ in range(n)]
    variants = [("float32", {}), ("bfloat16", {}), ("float32 paged 50% gate", dict(expert_budget=0.5, expert_prefetch="gate"))]
    if ck.on_cuda and not torch.cuda.is_bf16_supported():
        variants.pop(1)
    for label, kw in variants:
        llm = LLM(d, dtype=label.split()[0], device=str(ck.device), max_model_len=MAX_MODEL_LEN, max_num_seqs=n, **kw)
        llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        ck.sync()
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
        ck.sync()
        wall = time.perf_counter() - t0
        first = min(o.metrics.first_token_time for o in outs)
        last = max(o.metrics.last_token_time for o in outs)
        decode_tokens = sum(o.metrics.num_generation_tokens - 1 for o in outs)
        rec.data[label] = dict(
            requests=n, prompt_len=plen, output_len=out_len, wall_seconds=round(wall, 3),
            tokens_per_s=round(n * out_len / wall, 1),
            decode_tokens_per_s=round(decode_tokens / (last - first), 1) if last > first else None,
            decode_step_ms=round(1000 * (last - first) / max(out_len - 1, 1), 2),
            ttft_ms_max=round(1000 * max(o.metrics.ttft for o in outs), 1),
        )
        del llm
        gc.collect()
    rec.summary = ", ".join(f"{k}: {v['decode_tokens_per_s']} decode tok/s" for k, v in rec.data.items()
                            if isinstance(v, dict))


# ---- main ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for cuda_check.json")
    ap.add_argument("--device", default="cuda", help="torch device of the engine (default cuda)")
    ap.add_argument("--atol", type=float, default=1e-3, help="logit tolerance against the CPU engine and HF (default 1e-3)")
    ap.add_argument("--time-limit", type=float, default=240.0,
                    help="seconds after which no new check starts (default 240); a hang past it + 30 s exits")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--timing-tokens", type=int, default=64, help="output tokens per request in the timing check")
    ap.add_argument("--timing-concurrency", type=int, default=16, help="requests in flight in the timing check")
    ap.add_argument("--workdir", help="where to write the tiny checkpoints (default: a temporary directory, removed)")
    ap.add_argument("--only", nargs="*", help="run only checks whose names contain one of these strings")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    faulthandler.dump_traceback_later(args.time_limit + 30, exit=True)
    try:
        disable_tf32()
    except Exception as e:  # noqa: BLE001 - the env check's fp32 matmul test reports the outcome
        print(f"could not set full fp32 precision: {type(e).__name__}: {e}", flush=True)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except Exception:  # noqa: BLE001
        pass

    ck = Checker(args)
    print(f"moestream CUDA check on {ck.device}; results -> {ck.path}", flush=True)
    ck.check("env", lambda r: check_env(ck, r))
    for mt in (*DENSE, *HYBRID):
        ck.check(f"checkpoint/{mt}", lambda r, mt=mt: check_checkpoint(ck, r, mt))
    ck.check("config/auto_prefetch", lambda r: check_auto_prefetch(ck, r), needs=["checkpoint/qwen3_moe"])
    for mt in DENSE:
        base = f"{mt}/device_greedy"
        ck.check(base, lambda r, mt=mt: check_device_greedy(ck, r, mt), needs=[f"checkpoint/{mt}"])
        for mode in ("gate", "history", "none"):
            ck.check(f"{mt}/paging_{mode}", lambda r, mt=mt, mode=mode: check_paging(ck, r, mt, mode), needs=[base])
        ck.check(f"{mt}/vs_cpu", lambda r, mt=mt: check_vs_cpu(ck, r, mt), needs=[base])
        ck.check(f"{mt}/hf_parity", lambda r, mt=mt: check_hf_parity(ck, r, mt), needs=[base])
    for mt in HYBRID:
        base = f"{mt}/device_greedy"
        ck.check(base, lambda r, mt=mt: check_device_greedy(ck, r, mt), needs=[f"checkpoint/{mt}"])
        ck.check(f"{mt}/state_swap", lambda r, mt=mt: check_state_swap(ck, r, mt), needs=[base])
        ck.check(f"{mt}/paging_gate_with_swap", lambda r, mt=mt: check_hybrid_paging(ck, r, mt),
                 needs=[f"{mt}/state_swap"])
        ck.check(f"{mt}/vs_cpu", lambda r, mt=mt: check_vs_cpu(ck, r, mt), needs=[base])
        ck.check(f"{mt}/hf_parity", lambda r, mt=mt: check_hf_parity(ck, r, mt), needs=[base])
    ck.check("bf16", lambda r: check_bf16(ck, r), needs=["checkpoint/qwen3_moe"])
    ck.check("sampler", lambda r: check_sampler(ck, r), needs=["checkpoint/qwen3_moe"])
    ck.check("timing", lambda r: check_timing(ck, r), needs=["checkpoint/qwen3_moe"])
    ck.runs.clear()
    faulthandler.cancel_dump_traceback_later()
    ck.write(complete=True)
    if not args.workdir and ck.env.get("workdir"):
        shutil.rmtree(ck.env["workdir"], ignore_errors=True)

    counts = ck.document(True)["counts"]
    print(f"\n{'check':38} {'status':6} {'s':>6}  summary", flush=True)
    for r in ck.records:
        print(f"{r.name:38} {r.status:6} {r.seconds:6.1f}  {(r.error or r.summary)[:150]}", flush=True)
    print(f"\n{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped in {ck.elapsed():.0f} s "
          f"on {ck.env.get('device_name', ck.device)}; details in {ck.path}", flush=True)
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
