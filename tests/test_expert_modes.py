"""Approximate expert modes (docs/expert_modes.md): resident-fold's, EAT's and ExFold's routing
changes on crafted cases (exact drops, folds, accounts, thresholds, counts), ExFold's projector
math on a crafted layer (folding onto exact scalar multiples reproduces the MoE output) and its
deterministic calibration; and on the trained demo: off by default and a no-op with every
expert resident (bit-exact), no more reads than exact mode at a 25% budget, exact requests of a
mixed batch unchanged in every mode, and bad modes refused with a message."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moestream import LLM, SamplingParams
from moestream.experts.eat import ExpertAccountTracker
from moestream.experts.exfold import ExFold
from moestream.experts.expert_mode import apply_folds
from moestream.experts.fold_projectors import FoldProjectors, ProjectorStats
from moestream.experts.resident import ResidentExpertStore
from moestream.experts.resident_fold import ResidentFold
from moestream.layers.expert_executor import make_expert_executor
from parity import LogitsRecorder, greedy_params

PROMPTS = ["def parse_args(argv):\n", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n"]
NEW_TOKENS = 24


class FakeStore:
    """`available_experts` of a paged store, fixed per layer."""

    def __init__(self, available: dict[int, list[int]]) -> None:
        self.available = available

    def available_experts(self, layer: int) -> list[int]:
        return self.available[layer]


def test_resident_fold_drops_exactly_the_cheap_misses() -> None:
    """8 experts, top-3; experts 0-3 resident. Row by row:
    0: (5 .5, 6 .3, 0 .2): 6 folds (.3 < .4, not resident), 5 is top-1 -> kept;
    1: (1 .6, 7 .25, 2 .15): 7 would fold, but row 3 (exact) needs 7 -> kept;
    2: (4 .7, 5 .2, 6 .1): 6 folds; 5 is kept, row 0's top-1 needs it anyway;
    3 (exact): (7 .5, 1 .3, 4 .2): untouched.
    Folded weight .3 + .1, experts 6 avoided once (rows 0 and 2 share the read)."""
    ids = torch.tensor([[5, 6, 0], [1, 7, 2], [4, 5, 6], [7, 1, 4]])
    weights = torch.tensor([[.5, .3, .2], [.6, .25, .15], [.7, .2, .1], [.5, .3, .2]])
    mode = ResidentFold(FakeStore({3: [0, 1, 2, 3]}), threshold=0.4)
    assert mode.modify(3, 8, weights, ids) == (weights, ids, None)  # no rows named: the router's own tensors
    mode.begin_step(torch.tensor([True, True, True, False]))
    w, i, keep = mode.modify(3, 8, weights, ids)
    assert keep.tolist() == [[True, False, True], [True, True, True], [True, True, False], [True, True, True]]
    assert i.tolist() == [[5, 5, 0], [1, 7, 2], [4, 5, 4], [7, 1, 4]]  # a dropped pair carries its top-1 id
    torch.testing.assert_close(w[0], torch.tensor([.5, 0., .2]) / .7, rtol=0, atol=1e-7)
    torch.testing.assert_close(w[2], torch.tensor([.7, .2, 0.]) / .9, rtol=0, atol=1e-7)
    assert torch.equal(w[1], weights[1]) and torch.equal(w[3], weights[3])  # rows without a drop: bit for bit
    s = mode.stats()
    assert (s["dropped_pairs"], s["misses_avoided"]) == (2, 1)
    assert s["folded_weight"] == pytest.approx(0.4) and s["routed_weight"] == pytest.approx(3.0)
    assert s["folded_fraction"] == pytest.approx(0.4 / 3.0)


def test_resident_fold_never_drops_a_top1_or_a_heavy_expert() -> None:
    """Nothing resident, threshold .3: only the pairs under it that are not their token's
    top-1 go (float32 routers' top-k need not be sorted, so the top-1 is the largest weight)."""
    ids = torch.tensor([[2, 3, 4], [6, 7, 1]])
    weights = torch.tensor([[0.25, 0.5, 0.25], [0.45, 0.35, 0.2]])
    mode = ResidentFold(FakeStore({0: []}), threshold=0.3)
    mode.begin_step(torch.tensor([True, True]))
    w, i, keep = mode.modify(0, 8, weights, ids)
    assert keep.tolist() == [[False, True, False], [True, True, False]]
    assert i.tolist() == [[3, 3, 3], [6, 7, 6]]
    assert w[0].tolist() == [0.0, 1.0, 0.0]
    torch.testing.assert_close(w[1], torch.tensor([0.45, 0.35, 0.0]) / 0.8, rtol=0, atol=1e-7)
    assert mode.stats()["misses_avoided"] == 3  # experts 2, 4 and 1


def _run(llm: LLM, modes: list[str | None]) -> list[tuple[list[int], LogitsRecorder]]:
    recs = [LogitsRecorder() for _ in PROMPTS]
    params = [greedy_params(r, NEW_TOKENS) for r in recs]
    for p, m in zip(params, modes):
        p.expert_mode = m
    outs = llm.generate(PROMPTS, params)
    return [(list(o.outputs[0].token_ids), r) for o, r in zip(outs, recs)]


@pytest.fixture(scope="module")
def exact_paged() -> tuple[LLM, list[tuple[list[int], LogitsRecorder]]]:
    llm = LLM("demo", dtype="float32", expert_budget=0.25, enable_prefix_caching=False)
    return llm, _run(llm, [None] * len(PROMPTS))


def test_resident_fold_with_every_expert_resident_is_exact() -> None:
    exact = _run(LLM("demo", dtype="float32"), [None] * len(PROMPTS))
    llm = LLM("demo", dtype="float32", expert_mode="resident-fold")
    assert llm.llm_engine.expert_mode is None and "expert_mode" not in llm.expert_stats()
    for (ta, ra), (tb, rb) in zip(exact, _run(llm, [None] * len(PROMPTS))):
        assert ta == tb and all(torch.equal(a, b) for a, b in zip(ra.logits, rb.logits))


def test_resident_fold_at_a_quarter_budget_reads_less(exact_paged) -> None:
    exact_llm, exact = exact_paged
    llm = LLM("demo", dtype="float32", expert_budget=0.25, enable_prefix_caching=False,
              expert_mode="resident-fold", resident_fold_threshold=0.5)
    folded = _run(llm, [None] * len(PROMPTS))
    e, f = exact_llm.expert_stats(), llm.expert_stats()
    mode = f["expert_mode"]
    print(f"misses exact {e['misses']}, resident-fold {f['misses']}; {mode}")
    assert mode["misses_avoided"] > 0 and 0.0 < mode["folded_fraction"] < 0.5
    assert f["misses"] < e["misses"]
    # every computed token of every request is in the mode: (prompt + outputs but the last) x 6 layers x top-2
    tok = llm.get_tokenizer()
    computed = sum(len(tok.encode(p)) for p in PROMPTS) + len(PROMPTS) * (NEW_TOKENS - 1)
    assert mode["routed_pairs"] == computed * 6 * 2 and all(len(t) == NEW_TOKENS for t, _ in folded)


@pytest.fixture(scope="module")
def demo_projectors(tmp_path_factory) -> str:
    """The demo's projectors, calibrated twice with the same text and seed (asserted equal)."""
    from safetensors.torch import load_file

    from moestream.server.cli import main

    d = tmp_path_factory.mktemp("projectors")
    paths = [str(d / f"p{i}.safetensors") for i in range(2)]
    for path in paths:
        assert main(["calibrate", "demo", "--dtype", "float32", "--num-seqs", "4", "--seq-len", "64",
                     "--seed", "3", "--output", path]) == 0
    a, b = load_file(paths[0]), load_file(paths[1])
    assert sorted(a) == [f"layers.{i}.{n}" for i in range(6) for n in ("alpha", "explained")]
    assert all(torch.equal(a[n], b[n]) for n in a)  # deterministic for a text and seed
    return paths[0]


@pytest.mark.parametrize("mode", ["resident-fold", "eat", "exfold"])
def test_exact_requests_of_a_mixed_batch_are_unchanged(exact_paged, demo_projectors, mode: str) -> None:
    """Requests 0 and 2 opt out ("exact"); 1 and 3 take the engine's mode."""
    _, exact = exact_paged
    llm = LLM("demo", dtype="float32", expert_budget=0.25, enable_prefix_caching=False, expert_mode=mode,
              resident_fold_threshold=0.5, exfold_projectors=demo_projectors, eat_threshold=1.0)
    mixed = _run(llm, ["exact", None, "exact", None])
    stats = llm.expert_stats()["expert_mode"]
    assert stats["mode"] == mode and stats["dropped_pairs"] > 0
    tok = llm.get_tokenizer()
    computed = sum(len(tok.encode(PROMPTS[i])) for i in (1, 3)) + 2 * (NEW_TOKENS - 1)
    assert stats["routed_pairs"] == computed * 6 * 2  # the mode saw its two requests' tokens only
    if mode == "eat":  # experts per token by layer, in the stats and on /metrics
        from moestream.server.async_engine import take_snapshot
        from moestream.server.metrics import _EngineCollector

        assert all(1.0 <= a < 2.0 for a in stats["activated_per_token"].values())
        family = next(m for m in _EngineCollector(lambda: take_snapshot(llm.llm_engine), lambda: 0).collect()
                      if m.name == "moestream:expert_mode_activated_experts")
        assert {s.labels["layer"]: s.value for s in family.samples} == {
            str(layer): v for layer, v in llm.expert_stats()["expert_mode"]["activated_per_token"].items()}
    for i in (0, 2):  # other rows per expert than the exact-only batch: float32 rounding at most
        (ta, ra), (tb, rb) = exact[i], mixed[i]
        assert ta == tb and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ra.logits, rb.logits))


def test_a_mode_the_engine_does_not_run_is_refused() -> None:
    with pytest.raises(ValueError, match="expert_mode must be None or one of exact, resident-fold"):
        SamplingParams(expert_mode="fold")
    llm = LLM("demo", dtype="float32")
    with pytest.raises(ValueError, match="needs an engine started with --expert-mode resident-fold"):
        llm.generate(["x"], SamplingParams(expert_mode="resident-fold", max_tokens=2))
    assert llm.generate(["x"], SamplingParams(expert_mode="exact", max_tokens=2))[0].outputs[0].token_ids


def test_eval_loss_command_matches_prompt_logprobs(tmp_path) -> None:
    """`moestream eval-loss`: its exact loss (teacher-forced through decode) equals the mean
    negative prompt logprob of the same sequences (prefill), and its resident-fold run reads
    less, with the counts in the JSON."""
    import json

    from moestream.demo import heldout_files
    from moestream.server.cli import main

    out = tmp_path / "loss.json"
    assert main(["eval-loss", "demo", "--dtype", "float32", "--num-seqs", "2", "--seq-len", "32", "--expert-budget",
                 "0.25", "--expert-mode", "resident-fold", "--resident-fold-threshold", "0.5", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r) == {"exact", "resident-fold"} and r["exact"]["tokens"] == r["resident-fold"]["tokens"] == 62
    llm = LLM("demo", dtype="float32")
    seqs = [llm.get_tokenizer().encode(open(f, encoding="utf-8", errors="replace").read())[:32]
            for f in heldout_files()[:2]]
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, prompt_logprobs=0))
    nll = [-o.prompt_logprobs[i][t].logprob for o, s in zip(outs, seqs) for i, t in enumerate(s) if i > 0]
    assert r["exact"]["loss"] == pytest.approx(sum(nll) / len(nll), abs=1e-4)
    folded = r["resident-fold"]["expert"]
    assert folded["expert_mode"]["misses_avoided"] > 0 and folded["misses"] < r["exact"]["expert"]["misses"]
    with pytest.raises(SystemExit, match="2"):  # argparse: invalid choice, with the choices listed
        main(["eval-loss", "demo", "--expert-mode", "fold"])


def test_server_expert_mode_field_and_metrics() -> None:
    """A resident-fold server: a request body's `expert_mode` "exact" opts out, a mode the
    server does not run is a 400 naming it (the server keeps serving), and /metrics counts
    the folding."""
    import httpx

    from live_server import LiveServer
    from moestream.config import EngineConfig
    from moestream.demo import demo_model_path
    from moestream.server.serving import ServerConfig

    server = LiveServer(EngineConfig(model=demo_model_path(), dtype="float32", max_model_len=256, expert_budget=0.25,
                                     expert_mode="resident-fold", resident_fold_threshold=0.5),
                        ServerConfig(served_model_names=("demo",)))
    try:
        url = server.base_url + "/v1/completions"
        body = {"model": "demo", "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}
        bad = httpx.post(url, json={**body, "expert_mode": "fold"}, timeout=60)
        assert bad.status_code == 400 and "expert_mode" in bad.json()["error"]["message"]
        exact = httpx.post(url, json={**body, "expert_mode": "exact"}, timeout=60)
        assert exact.status_code == 200
        before = server.engine.expert_stats()["expert_mode"]["dropped_pairs"]
        assert before == 0  # the exact request folded nothing
        folded = httpx.post(url, json=body, timeout=60)
        assert folded.status_code == 200
        server.wait_idle()
        dropped = server.engine.expert_stats()["expert_mode"]["dropped_pairs"]
        text = httpx.get(server.base_url + "/metrics", timeout=60).text
        line = next(ln for ln in text.splitlines() if ln.startswith("moestream:expert_mode_dropped_pairs_total"))
        assert dropped > 0 and float(line.split()[-1]) == dropped
    finally:
        server.stop()


def test_an_exact_request_never_reuses_folded_kv() -> None:
    """Regression: with prefix caching on, an exact request that followed a resident-fold
    request with the same prompt reused the KV blocks computed with folded experts, and its
    output was no longer exact. Blocks are now salted with the mode (vLLM's cache_salt): the
    exact requests hit none of the folded blocks and get the exact-only run's tokens, and a
    second round of folding requests hits the folded ones."""
    prompts = [p * 4 for p in PROMPTS]  # 2+ full KV blocks each

    def run(llm: LLM, mode: str | None) -> list[tuple[list[int], LogitsRecorder]]:
        recs = [LogitsRecorder() for _ in prompts]
        params = [greedy_params(r, NEW_TOKENS) for r in recs]
        for p in params:
            p.expert_mode = mode
        return [(list(o.outputs[0].token_ids), r) for o, r in zip(llm.generate(prompts, params), recs)]

    exact = run(LLM("demo", dtype="float32", expert_budget=0.25, enable_prefix_caching=False), None)
    llm = LLM("demo", dtype="float32", expert_budget=0.25, expert_mode="resident-fold", resident_fold_threshold=1.0)
    run(llm, None)  # folded prefills fill the prefix cache
    assert llm.llm_engine.prefix_cache_stats()["hits"] == 0
    again = run(llm, "exact")
    assert llm.llm_engine.prefix_cache_stats()["hits"] == 0  # nothing folded served the exact requests
    for (ta, ra), (tb, rb) in zip(exact, again):
        assert ta == tb and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ra.logits, rb.logits))
    run(llm, None)
    assert llm.llm_engine.prefix_cache_stats()["hits"] > 0  # folded requests share their own blocks


@pytest.mark.parametrize("flags, message", [
    (["--seq-len", "40", "--max-model-len", "16"], "--seq-len 40 needs --max-model-len of at least 40"),
    (["--json", "/nonexistent_dir/x.json"], "its directory does not exist"),
])
def test_eval_loss_refuses_bad_flags_before_loading(flags: list[str], message: str, capsys) -> None:
    from moestream.server.cli import main

    assert main(["eval-loss", "demo", "--num-seqs", "1", *flags]) == 2
    assert message in capsys.readouterr().err


def test_folds_merge_onto_kept_pairs_and_replace_the_rest() -> None:
    """apply_folds: row 0 folds pair 2 (expert 5) onto its own expert 1 (merged: .3 + 2 x .1);
    row 1 folds expert 6 onto expert 2, which it does not have (the pair becomes expert 2
    with alpha x w), and drops expert 7 (alpha 0; its id becomes an expert the row keeps);
    row 2 folds nothing and keeps the router's weights bit for bit."""
    w = np.array([[.6, .3, .1], [.5, .3, .2], [.4, .35, .25]], dtype=np.float32)
    e = np.array([[0, 1, 5], [3, 6, 7], [0, 1, 2]])
    fold = np.array([[False, False, True], [False, True, True], [False, False, False]])
    target = np.array([[0, 0, 1], [0, 2, 0], [0, 0, 0]])
    alpha = np.array([[0, 0, 2.0], [0, -0.5, 0], [0, 0, 0]], dtype=np.float32)
    new_w, new_e, keep = apply_folds(w, e, fold, target, alpha)
    assert keep.tolist() == [[True, True, False], [True, True, False], [True, True, True]]
    assert new_e.tolist() == [[0, 1, 0], [3, 2, 3], [0, 1, 2]]
    np.testing.assert_allclose(new_w[:2], [[.6, .5, 0], [.5, -.15, 0]], rtol=0, atol=1e-7)
    assert np.array_equal(new_w[2], w[2])


def test_eat_accounts_thresholds_and_activated_counts_on_a_fixed_history() -> None:
    """E = 4, top-2, decay .5, threshold 1. Hand-computed:
    layer 0, call 1: shares (.65, .2, .15, 0) -> accounts .5 x .25 + .5 x share =
      (.45, .225, .2, .125); m = mean top-1 = .65; scores of the second pairs .4 x 4 x .225
      = .36 and .3 x 4 x .2 = .24, both under .65: dropped (1 expert per token).
    layer 0, call 2: shares (.5, 0, 0, .5) -> (.475, .1125, .1, .3125); m = .575; the second
      pair (expert 0) scores .5 x 4 x .475 = .95: kept (2 experts).
    layer 1, call 1: (.125, .575, .125, .175); m = .9; .1 x 4 x .175 = .07: dropped.
    Row 2 of call 1 is exact: untouched and not counted."""
    mode = ExpertAccountTracker(threshold=1.0, decay=0.5)
    mode.begin_step(torch.tensor([True, True, False]))
    w, i, keep = mode.modify(0, 4, torch.tensor([[.6, .4], [.7, .3], [.5, .5]]), torch.tensor([[0, 1], [0, 2], [1, 3]]))
    np.testing.assert_allclose(mode.accounts[0], [.45, .225, .2, .125], rtol=0, atol=1e-7)
    assert mode.layer_threshold(0) == pytest.approx(.65, abs=1e-7)
    assert keep.tolist() == [[True, False], [True, False], [True, True]]
    assert w[:2, 0].tolist() == pytest.approx([1.0, 1.0]) and w[2].tolist() == pytest.approx([.5, .5])
    mode.begin_step(torch.tensor([True]))
    w, i, keep = mode.modify(0, 4, torch.tensor([[.5, .5]]), torch.tensor([[3, 0]]))
    np.testing.assert_allclose(mode.accounts[0], [.475, .1125, .1, .3125], rtol=0, atol=1e-7)
    assert mode.layer_threshold(0) == pytest.approx(.575, abs=1e-7) and keep is None
    w, i, keep = mode.modify(1, 4, torch.tensor([[.9, .1]]), torch.tensor([[1, 3]]))
    np.testing.assert_allclose(mode.accounts[1], [.125, .575, .125, .175], rtol=0, atol=1e-7)
    assert keep.tolist() == [[True, False]] and i.tolist() == [[1, 1]]
    s = mode.stats()
    assert s["activated_per_token"] == {0: pytest.approx(4 / 3), 1: 1.0}
    assert (s["routed_pairs"], s["dropped_pairs"]) == (8, 3)


def test_exfold_on_exact_multiples_reproduces_the_moe_output() -> None:
    """A crafted layer: experts 3, 4, 5 are 2 x, -0.5 x and 0.25 x experts 0, 1, 2 (their
    down projections scaled). Calibrated projectors find those scalars (explained 1), and
    ExFold's folds (prefill top-1, and a decode pool of 3 that leaves experts 0, 4 and 5
    out) give the exact layer's output within 1e-6 while computing fewer pairs."""
    torch.manual_seed(0)
    E, H, I = 6, 16, 8
    gate_up, down = torch.randn(3, 2 * I, H) / 4, torch.randn(3, H, I) / 4
    scale = torch.tensor([2.0, -0.5, 0.25])
    store = ResidentExpertStore()
    store.set_layer(0, torch.cat([gate_up, gate_up]), torch.cat([down, down * scale[:, None, None]]))
    ex = make_expert_executor(store, 0, E)
    x = torch.randn(7, H)

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        return ex.forward(rows, torch.ones(len(rows), 1), torch.full((len(rows), 1), e))

    stats = ProjectorStats(E)
    calib = torch.randn(32, H)
    stats.add(torch.stack([expert(e, calib) for e in range(E)], 1), torch.ones(32, E, dtype=torch.bool))
    alpha, explained = stats.projectors()
    for e, r, a in [(3, 0, 2.0), (0, 3, 0.5), (1, 4, -2.0), (5, 2, 0.25)]:
        assert alpha[e, r].item() == pytest.approx(a, rel=1e-6) and explained[e, r].item() == pytest.approx(1, rel=1e-6)
    proj = FoldProjectors({0: alpha.numpy()}, {0: explained.numpy()}, {})
    ids = torch.tensor([[0, 3], [4, 1], [0, 1], [2, 5], [3, 1], [2, 4], [5, 0]])
    weights = torch.tensor([[.6, .4], [.7, .3], [.5, .5], [.8, .2], [.6, .4], [.5, .5], [.6, .4]])
    mode = ExFold(proj, prefill_k=1, pool_size=3)
    mode.begin_step(torch.tensor([True] * 6 + [False]), torch.tensor([True, True] + [False] * 5))
    w, i, keep = mode.modify(0, E, weights, ids)
    # decode totals: 2: 1.3, 1: .9, 3: .6, 0: .5, 4: .5, 5: .2 -> pool {1, 2, 3}
    assert i[2:6][keep[2:6]].unique().tolist() == [1, 2, 3] and torch.equal(i[6], ids[6])
    assert keep.tolist() == [[True, False], [True, False], [True, True], [True, False], [True, True], [True, True],
                             [True, True]]
    torch.testing.assert_close(ex.forward(x, w, i, keep), ex.forward(x, weights, ids), rtol=0, atol=1e-6)
    assert mode.stats()["dropped_pairs"] == 3


def test_exfold_needs_projectors_of_this_model(tmp_path, demo_projectors) -> None:
    from safetensors.torch import load_file, save_file

    with pytest.raises(FileNotFoundError, match="moestream calibrate"):
        LLM("demo", dtype="float32", expert_mode="exfold", exfold_projectors=str(tmp_path / "none.safetensors"))
    t = load_file(demo_projectors)
    save_file({n: v[:4, :4].contiguous() for n, v in t.items()}, str(tmp_path / "small.safetensors"),
              metadata={"format": "moestream-exfold-projectors/1"})
    with pytest.raises(ValueError, match=r"layer 0 needs \[16, 16\] projectors"):
        LLM("demo", dtype="float32", expert_mode="exfold", exfold_projectors=str(tmp_path / "small.safetensors"))
    (tmp_path / "garbage.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="is not a readable safetensors file"):
        LLM("demo", dtype="float32", expert_mode="exfold", exfold_projectors=str(tmp_path / "garbage.safetensors"))
    save_file(t, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="is not an ExFold projector file"):
        LLM("demo", dtype="float32", expert_mode="exfold", exfold_projectors=str(tmp_path / "other.safetensors"))


@pytest.mark.parametrize("kw, message", [
    (dict(expert_mode="resident-fold", resident_fold_threshold=0.0), r"resident_fold_threshold must be in \(0, 1\]"),
    (dict(expert_mode="resident-fold", resident_fold_threshold=1.5), r"resident_fold_threshold must be in \(0, 1\]"),
    (dict(expert_mode="eat", eat_threshold=0.0), "eat_threshold must be a number above 0"),
    (dict(expert_mode="eat", eat_decay=1.0), r"eat_decay must be in \[0, 1\)"),
    (dict(expert_mode="exfold", exfold_pool_size=0), "exfold_pool_size must be a positive integer"),
])
def test_bad_mode_parameters_are_refused(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM("demo", dtype="float32", **kw)


def test_a_token_never_loses_every_expert() -> None:
    """Regression: ExFold's decode pool could leave a token whose experts all lay outside the
    pool with alpha 0 (experts never routed in calibration), and apply_folds then raised
    inside the forward, failing the whole step. Now a pair without a projector is computed
    as routed, and a row that would drop everything keeps its heaviest pair."""
    alpha = np.zeros((8, 8), dtype=np.float32)
    alpha[:6, :6] = 0.5  # experts 6 and 7 were never routed in calibration
    proj = FoldProjectors({0: alpha}, {0: np.abs(alpha)}, {})
    mode = ExFold(proj, prefill_k=1, pool_size=2)
    mode.begin_step(np.array([True, True, True]))
    ids = torch.tensor([[0, 1], [0, 1], [6, 7]])
    w, i, keep = mode.modify(0, 8, torch.tensor([[.6, .4], [.7, .3], [.55, .45]]), ids)  # pool {0, 1}
    assert keep is None or keep[2].all()  # experts 6, 7: no projector, computed as routed
    drop = ExpertAccountTracker(threshold=1.0, decay=0.5)  # drops only: folds with alpha 0
    drop.decide = lambda *a: (np.ones((1, 2), dtype=bool), np.zeros((1, 2), dtype=np.int64),
                              np.zeros((1, 2), dtype=np.float32))
    drop.begin_step(np.array([True]))
    w, i, keep = drop.modify(0, 8, torch.tensor([[.3, .7]]), torch.tensor([[2, 5]]))
    assert keep.tolist() == [[False, True]] and i.tolist() == [[5, 5]] and w[0, 1].item() == pytest.approx(1.0)


def test_recomputed_output_tokens_are_prompt_rows() -> None:
    """Regression: after a preemption, a request's recomputed output tokens were classed as
    decode rows, and ExFold's batch-wide decode pool was taken over by them. A step now has
    at most one decode row per request (no drafts here); the rest are prompt rows."""
    from moestream.engine.kv_cache import kv_block_bytes
    from moestream.models.hf_config import model_config_from_hf
    from moestream.demo import demo_model_path

    mc = model_config_from_hf(demo_model_path())
    block = kv_block_bytes(mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, torch.float32)
    llm = LLM("demo", dtype="float32", max_model_len=128, kv_cache_memory_bytes=10 * block, expert_mode="eat",
              enable_prefix_caching=False)
    mode, steps = llm.llm_engine.runner.expert_mode, []
    begin = mode.begin_step

    def record(rows, prefill=None):
        if rows is not None:
            steps.append((len(rows), int((~prefill).sum())))
        begin(rows, prefill)

    mode.begin_step = record
    llm.generate([p * 3 for p in PROMPTS * 2], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert steps and all(decode <= 8 for _, decode in steps)
    assert max(t for t, _ in steps) > 8  # prompt (and recompute) steps were seen


@pytest.mark.parametrize("flags, message", [
    (["--expert-budget", "0.25"], "run it with every expert resident"),
    (["--output", "/nonexistent_dir/p.safetensors"], "its directory does not exist"),
    (["--expert-mode", "eat"], "calibrate runs exact"),
])
def test_calibrate_refuses_bad_flags_before_loading(flags: list[str], message: str, capsys) -> None:
    from moestream.server.cli import main

    assert main(["calibrate", "demo", *flags]) == 2
    assert message in capsys.readouterr().err
