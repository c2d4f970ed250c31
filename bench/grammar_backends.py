"""Structured-output grammar backends compared: llguidance, xgrammar, outlines-core.

For each tokenizer (the built-in demo model's, and the Qwen2 one in tests/fixtures: a
151k-token vocabulary) and each backend that imports, measures
- import time of each library (xgrammar loads tvm_ffi), once per process;
- setup: tokenizer conversion (plus one warm-up mask where the backend builds a trie lazily);
- compile: schema/regex to a matcher ready for its first mask (median of 3; xgrammar with
  its cache off). JSON is compact (llguidance whitespace_flexible=False, xgrammar
  any_whitespace=False with (',', ':'); outlines-core has its default `[ ]?` whitespace);
- mask: a fixed valid instance of SCHEMA, tokenized, walked token by token: the full-vocabulary
  bitmask is filled before each token (and once after the last), the token checked against
  it, the matcher advanced; one untimed warm walk (its first mask is reported), 5 timed walks;
- coverage (demo tokenizer only): per JSON-schema feature, "yes" when the schema compiles, a
  valid instance is accepted and a violating one rejected; "loose" when the violating one is
  accepted too; "rejects valid"; or the error text.
One thread (torch.set_num_threads(1), xgrammar max_threads=1). Writes OUT.json, OUT.md and
OUT.png (mean mask time per backend and tokenizer). Install weight is not measured here: see
docs/structured_outputs.md.

    python bench/grammar_backends.py --out bench/results/grammar_backends
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from structured_outputs import SCHEMA  # noqa: E402  (nested object, enum, bounded array, required fields)

INSTANCE = {"name": "parse_arguments", "kind": "function", "args": [1, 22, 333], "meta": {"public": True}}
REGEX = r"[a-z]+@[a-z]+\.(com|org)"
_OBJ = lambda props, **kw: {"type": "object", "properties": props, "required": list(props), **kw}
FEATURES = {  # feature: (schema, valid instance, violating instance)
    "pattern": ({"type": "string", "pattern": "^[a-z]{3}[0-9]$"}, "abc1", "abcd"),
    "format: email": ({"type": "string", "format": "email"}, "ann@example.com", "not an email"),
    "format: date-time": ({"type": "string", "format": "date-time"}, "2024-05-06T07:08:09Z", "yesterday"),
    "minLength": ({"type": "string", "minLength": 5}, "hello", "hi"),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, 5, True),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "x"),
    "allOf": ({"allOf": [_OBJ({"a": {"type": "integer"}}), _OBJ({"b": {"type": "string"}})]}, {"a": 1, "b": "x"}, {"a": 1}),
    "$ref/$defs": ({"$defs": {"p": _OBJ({"x": {"type": "integer"}})}, **_OBJ({"p": {"$ref": "#/$defs/p"}})},
                   {"p": {"x": 1}}, {"p": {"x": "a"}}),
    "additionalProperties: false": (_OBJ({"a": {"type": "integer"}}, additionalProperties=False), {"a": 1}, {"a": 1, "b": 2}),
    "const": ({"const": "fixed"}, "fixed", "other"),
    "enum": ({"enum": ["red", "green", 3]}, "green", "blue"),
    "minimum/maximum": ({"type": "integer", "minimum": 10, "maximum": 20}, 15, 25),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
}
dumps = lambda x: json.dumps(x, separators=(",", ":"))


class Guidance:
    def __init__(self, tok):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg, self.tok = llguidance, llguidance.hf.from_tokenizer(tok, n_vocab=None)
        self.vocab = self.tok.vocab_size
        self.fill(self.matcher(self.compile_regex("a")), self.bitmask())  # builds its token trie

    def _check(self, g):
        err = self.llg.LLMatcher.validate_grammar(g, self.tok)
        if err:
            raise ValueError(err)
        return g
    compile_json = lambda s, x: s._check(s.llg.LLMatcher.grammar_from_json_schema(dumps(x), defaults={"whitespace_flexible": False}))
    compile_regex = lambda s, r: s._check(s.llg.LLMatcher.grammar_from_regex(r))
    matcher = lambda s, g: s.llg.LLMatcher(s.tok, g, log_level=0)
    bitmask = lambda s: s.llg.torch.allocate_token_bitmask(1, s.vocab)
    fill = lambda s, m, b: s.llg.torch.fill_next_token_bitmask(m, b, 0)
    advance = lambda s, m, t: bool(m.consume_token(t)) and not m.is_error()
    accepting = lambda s, m: m.is_accepting()


class XGrammar:
    def __init__(self, tok):
        import xgrammar
        self.xgr, self.info = xgrammar, xgrammar.TokenizerInfo.from_huggingface(tok)
        self.vocab, self.compiler = self.info.vocab_size, xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
    compile_json = lambda s, x: s.compiler.compile_json_schema(dumps(x), any_whitespace=False, separators=(",", ":"))
    compile_regex = lambda s, r: s.compiler.compile_regex(r)
    matcher = lambda s, g: s.xgr.GrammarMatcher(g)
    bitmask = lambda s: s.xgr.allocate_token_bitmask(1, s.vocab)
    fill = lambda s, m, b: m.fill_next_token_bitmask(b, 0)
    advance = lambda s, m, t: m.accept_token(t)
    accepting = lambda s, m: m.is_completed()


class Outlines:
    def __init__(self, tok):
        import outlines_core
        self.oc = outlines_core
        if "ByteLevel" not in str(tok.backend_tokenizer.decoder):
            raise RuntimeError("no offline vocabulary: only byte-level BPE is converted here")
        bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))  # GPT-2 bytes_to_unicode
        rest = [n for n in range(256) if n not in bs]
        byte_of = {chr(c): b for b, c in zip(bs + rest, bs + [256 + i for i in range(len(rest))])}
        special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
        vocab: dict[bytes, list[int]] = {}
        for piece, i in tok.get_vocab().items():
            if i not in special:
                key = bytes(byte_of[c] for c in piece) if all(c in byte_of for c in piece) else piece.encode()
                vocab.setdefault(key, []).append(i)
        self.voc, self.vocab = outlines_core.Vocabulary(tok.eos_token_id, vocab), len(tok)
    compile_json = lambda s, x: s.oc.Index(s.oc.json_schema.build_regex_from_schema(dumps(x)), s.voc)
    compile_regex = lambda s, r: s.oc.Index(r, s.voc)
    matcher = lambda s, g: s.oc.Guide(g)
    bitmask = lambda s: torch.zeros(1, (s.vocab + 31) // 32, dtype=torch.int32)
    fill = lambda s, m, b: m.write_mask_into(b.data_ptr(), b.numel(), 4)
    accepting = lambda s, m: m.is_finished()

    def advance(self, m, t):
        try:
            m.advance(t, return_tokens=False)
            return True
        except Exception:  # noqa: BLE001
            return False


BACKENDS = {"llguidance": Guidance, "xgrammar": XGrammar, "outlines-core": Outlines}


def accepts(b, g, tokens) -> bool:
    m = b.matcher(g)
    return all(b.advance(m, t) for t in tokens) and b.accepting(m)


def walk(b, g, tokens) -> list[float]:
    """Seconds per mask along `tokens` (and one after them); raises if a token is masked off."""
    m, mask, times = b.matcher(g), b.bitmask(), []
    for t in tokens + [None]:
        t0 = time.perf_counter()
        b.fill(m, mask)
        times.append(time.perf_counter() - t0)
        if t is not None and not ((int(mask[0, t // 32]) >> (t % 32)) & 1 and b.advance(m, t)):
            raise RuntimeError(f"token {t} masked off or refused")
    return times


def measure(name, tok, coverage: bool) -> dict:
    t0 = time.perf_counter()
    try:
        b = BACKENDS[name](tok)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    r = {"setup_s": time.perf_counter() - t0, "vocab": b.vocab}
    if name == "outlines-core":
        try:  # its documented constructor: fetches tokenizer.json from the hub by model id
            b.oc.Vocabulary.from_pretrained(tok.name_or_path)
            r["from_pretrained"] = "ok"
        except Exception as e:  # noqa: BLE001
            r["from_pretrained"] = f"fails: {str(e)[:160]}"
    for kind, fn, arg in (("json", b.compile_json, SCHEMA), ("regex", b.compile_regex, REGEX)):
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            b.matcher(g := fn(arg))
            ts.append(time.perf_counter() - t0)
        r[f"compile_{kind}_ms"] = statistics.median(ts) * 1e3
    g = b.compile_json(SCHEMA)
    tokens = tok.encode(dumps(INSTANCE), add_special_tokens=False)
    r["first_mask_us"] = walk(b, g, tokens)[0] * 1e6
    times = [x for _ in range(5) for x in walk(b, g, tokens)]
    r.update(tokens=len(tokens), masks=len(times), mask_mean_us=statistics.mean(times) * 1e6,
             mask_p50_us=statistics.median(times) * 1e6, regex_text_ok=accepts(b, b.compile_regex(REGEX), tok.encode("ann@example.org", add_special_tokens=False)))
    if coverage:
        r["coverage"] = {}
        for feat, (schema, good, bad) in FEATURES.items():
            try:
                g = b.compile_json(schema)
                ok, loose = (accepts(b, g, tok.encode(dumps(x), add_special_tokens=False)) for x in (good, bad))
                r["coverage"][feat] = "rejects valid" if not ok else "loose" if loose else "yes"
            except Exception as e:  # noqa: BLE001
                r["coverage"][feat] = "error: " + " ".join(str(e).split())[:200]
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/grammar_backends")
    out = ap.parse_args().out
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from moestream.demo import demo_model_path
    toks = {"demo": demo_model_path(), "qwen2": os.path.join(ROOT, "tests/fixtures/tokenizers/qwen2")}
    res: dict = {"versions": {}, "import_s": {}, "tokenizers": {}}
    for pkg, mod in (("llguidance", "llguidance.torch"), ("xgrammar", "xgrammar"), ("outlines-core", "outlines_core"),
                     ("triton", None), ("torch", None)):
        try:
            res["versions"][pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            res["versions"][pkg] = None
        if mod and res["versions"][pkg]:  # a fresh import (before any use), in seconds
            t0 = time.perf_counter()
            importlib.import_module(mod)
            res["import_s"][pkg] = time.perf_counter() - t0
    for tname, path in toks.items():
        if not os.path.isdir(path):
            res["tokenizers"][tname] = {"skipped": f"{path} missing"}
            continue
        tok = AutoTokenizer.from_pretrained(path)
        res["tokenizers"][tname] = {n: measure(n, tok, tname == "demo") for n in BACKENDS}
        print(tname, json.dumps(res["tokenizers"][tname], indent=1), flush=True)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    lines = ["| tokenizer | backend | vocab | setup (s) | compile JSON (ms) | compile regex (ms) | first mask (µs) | mask mean (µs) | mask p50 (µs) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for tname, rs in res["tokenizers"].items():
        for n, r in rs.items() if "skipped" not in rs else [("-", {"error": rs["skipped"]})]:
            lines.append(f"| {tname} | {n} | " + (f"error: {r['error']} |" if "error" in r else " | ".join(
                [str(r["vocab"]), f"{r['setup_s']:.2f}"] + [f"{r[k]:.1f}" for k in ("compile_json_ms", "compile_regex_ms", "first_mask_us", "mask_mean_us", "mask_p50_us")]) + " |"))
    cov = {n: r.get("coverage", {}) for n, r in res["tokenizers"].get("demo", {}).items()}
    lines += ["", "| feature (demo tokenizer) | " + " | ".join(cov) + " |", "|---|" + "---|" * len(cov)]
    lines += [f"| {f} | " + " | ".join(c.get(f, "-") for c in cov.values()) + " |" for f in FEATURES]
    imports = {k: round(v, 2) for k, v in res["import_s"].items()}
    with open(out + ".md", "w") as f:
        f.write(f"Versions: {res['versions']}\n\nImport (s): {imports}\n\n" + "\n".join(lines) + "\n")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from report import pyplot

    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        names = [t for t, rs in res["tokenizers"].items() if "skipped" not in rs]
        for i, backend in enumerate(BACKENDS):
            vals = [res["tokenizers"][t][backend].get("mask_mean_us", 0.0) for t in names]
            ax.bar([j + 0.27 * (i - 1) for j in range(len(names))], vals, width=0.27, label=backend)
        ax.set_xticks(range(len(names)), [f"{t} ({res['tokenizers'][t][next(iter(BACKENDS))].get('vocab', '?')} tokens)"
                                          for t in names])
        ax.set(ylabel="mean mask time (us per token)", title="grammar backends: one full-vocabulary mask")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out + ".png", dpi=120)


if __name__ == "__main__":
    main()
