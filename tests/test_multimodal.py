"""Images on Qwen3.5-MoE's multimodal checkpoint: HF float32 parity (one image, two, an image
mid-text; batched with text; a chunked prefill splitting an image; a prefix hit on the second
sighting), M-RoPE positions against HF's `get_rope_index`, multimodal block hashes, the image
processor against HF's, and bad images refused with nothing leaked."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from scripted_proposer import ScriptedProposer
from tiny_checkpoint import VL_TOKENS, make_tiny_checkpoint
from parity import LogitsRecorder, ParityReport, check_parity, greedy_params

from moestream import LLM, SamplingParams

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE_ID = VL_TOKENS["image_token_id"]
VIDEO_ID = VL_TOKENS["video_token_id"]
NEW_TOKENS = 16


def random_image(seed: int, width: int, height: int) -> Image.Image:
    rs = np.random.RandomState(seed)
    return Image.fromarray((rs.rand(height, width, 3) * 255).astype(np.uint8))


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("vl")), "qwen3_5_moe_vl", seed=4)


@pytest.fixture(scope="module")
def vl_llm(vl_dir: str) -> LLM:
    return LLM(vl_dir, dtype="float32", max_model_len=256)


class HFMultimodalReference:
    """HF `Qwen3_5MoeForConditionalGeneration` in float32, greedy. Image pixels come from HF's
    own image processor (`Qwen2VLImageProcessorPil` from the checkpoint); the prompt text is
    expanded by HF's `Qwen3VLProcessor.replace_video_token` and `replace_image_token` rules,
    then tokenized whole, as HF's processor does. Video pixels are moestream's (HF's video
    processor needs torchvision), so videos test the model path and the expansion."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForImageTextToText, AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)

    def _video_placeholder(self, grid: list[int], num_frames: int, fps: float) -> str:
        from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
        from transformers.video_utils import VideoMetadata

        proc = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
                               video_token="<|video_pad|>", vision_start_token="<|vision_start|>",
                               vision_end_token="<|vision_end|>")
        proc._calculate_timestamps = lambda *a: Qwen3VLProcessor._calculate_timestamps(proc, *a)
        meta = VideoMetadata(total_num_frames=num_frames, fps=fps, frames_indices=list(range(num_frames)))
        return Qwen3VLProcessor.replace_video_token(
            proc, {"video_grid_thw": torch.tensor([grid]), "video_metadata": [meta]}, 0)

    def inputs(self, prompt: str, images: list[Image.Image], videos: list[tuple] = ()) -> dict:
        """videos: (frames [T, H, W, 3], fps, pixel rows, grid) each."""
        out: dict = {}
        text = prompt
        if images:
            pv = self.image_processor(images=images, return_tensors="pt")
            out = {"pixel_values": pv["pixel_values"], "image_grid_thw": pv["image_grid_thw"]}
            for g in pv["image_grid_thw"].tolist():
                text = text.replace(IMAGE, IMAGE.replace("<|image_pad|>", "<|placeholder|>" * (g[0] * g[1] * g[2] // 4)), 1)
            text = text.replace("<|placeholder|>", "<|image_pad|>")
        if videos:
            for frames, fps, _, grid in videos:
                text = text.replace("<|video_pad|>", self._video_placeholder(grid, len(frames), fps).replace(
                    "<|video_pad|>", "<|placeholder|>"), 1)
            text = text.replace("<|placeholder|>", "<|video_pad|>")
            out.update(pixel_values_videos=torch.cat([v[2] for v in videos]),
                       video_grid_thw=torch.tensor([v[3] for v in videos]))
        input_ids = torch.tensor([self.tokenizer.encode(text)])
        types = (input_ids == IMAGE_ID).int() + 2 * (input_ids == VIDEO_ID).int()
        out.update(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=types)
        return out

    def generate(self, prompt: str, images: list[Image.Image], videos: list[tuple] = ()
                 ) -> tuple[list[int], list[int], torch.Tensor]:
        """(expanded prompt ids, greedy tokens, logits [n, V] float32)."""
        inputs = self.inputs(prompt, images, videos)
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                      return_dict_in_generate=True, pad_token_id=0)
        n = inputs["input_ids"].shape[1]
        return inputs["input_ids"][0].tolist(), out.sequences[0, n:].tolist(), torch.stack([x[0] for x in out.logits])


@pytest.fixture(scope="module")
def hf_vl(vl_dir: str) -> HFMultimodalReference:
    return HFMultimodalReference(vl_dir)


IMAGES = [random_image(1, 48, 32), random_image(2, 40, 56), random_image(3, 64, 64)]
# (prompt, images): one image, two images, an image in the middle of text, text only.
CASES = [
    (f"{IMAGE}What is in this picture?", [IMAGES[0]]),
    (f"Compare {IMAGE} with {IMAGE} in one word.", [IMAGES[1], IMAGES[2]]),
    (f"A long preamble about nothing in particular, then {IMAGE} and a question about it: why?", [IMAGES[2]]),
    ("Plain text, no picture at all.", []),
]


def _mm_prompt(prompt: str, images: list[Image.Image]) -> dict:
    return {"prompt": prompt, "multi_modal_data": {"image": images}} if images else {"prompt": prompt}


def _run(llm: LLM, cases: list) -> list[tuple[list[int], list[int], LogitsRecorder]]:
    recs = [LogitsRecorder() for _ in cases]
    outs = llm.generate([_mm_prompt(p, ims) for p, ims in cases], [greedy_params(r, NEW_TOKENS) for r in recs])
    return [(o.prompt_token_ids, o.outputs[0].token_ids, r) for o, r in zip(outs, recs)]


def _check(results: list, cases: list, hf_vl: HFMultimodalReference, label: str) -> None:
    report = ParityReport()
    for i, ((prompt_ids, tokens, rec), (prompt, images)) in enumerate(zip(results, cases)):
        ref_ids, ref_tokens, ref_logits = hf_vl.generate(prompt, images)
        assert prompt_ids == ref_ids, f"{label} case {i}: expanded prompt differs from HF's"
        check_parity(tokens, rec.logits, ref_tokens, ref_logits, report, f"{label} case {i}")
    print(f"{label}: max logit diff {report.max_logit_diff:.2e}, ties {len(report.ties)}")


def test_images_match_hf_batched_with_text(vl_llm: LLM, hf_vl: HFMultimodalReference) -> None:
    """All four cases in one batch (three with images, one text only): token-exact, logits
    within 1e-4 of HF's."""
    _check(_run(vl_llm, CASES), CASES, hf_vl, "batched")


def test_image_changes_the_output(vl_llm: LLM) -> None:
    """The vision embeddings reach the model: another image, other logits."""
    p = SamplingParams(temperature=0, max_tokens=4, logprobs=0)
    a, b = vl_llm.generate([_mm_prompt(CASES[0][0], [IMAGES[0]]), _mm_prompt(CASES[0][0], [IMAGES[1]])], p)
    assert a.outputs[0].logprobs != b.outputs[0].logprobs


def test_chunked_prefill_splits_images(vl_dir: str, hf_vl: HFMultimodalReference) -> None:
    """A 5-token step budget splits every image across steps (each image is 6-16 tokens):
    still HF-exact, and each image's embeddings are dropped once its tokens are computed."""
    llm = LLM(vl_dir, dtype="float32", max_model_len=256, max_num_batched_tokens=5, max_num_seqs=2)
    cases = CASES[:3]
    _check(_run(llm, cases), cases, hf_vl, "chunked")
    assert not llm.llm_engine.requests


def test_prefix_hit_on_second_sighting_is_exact(vl_dir: str, hf_vl: HFMultimodalReference) -> None:
    """The same image and text a second time hits the prefix cache (blocks covering the image
    included) and stays HF-exact; the same text with another image hits only the blocks before
    the image (its linear-attention state checkpointed every block, so that a hit can end
    anywhere)."""
    llm = LLM(vl_dir, dtype="float32", max_model_len=256, block_size=4, state_checkpoint_interval=4)
    prompt = CASES[2][0]
    first = _run(llm, [(prompt, [IMAGES[2]])])
    assert llm.prefix_cache_stats()["hits"] == 0
    second = _run(llm, [(prompt, [IMAGES[2]])])
    num_prompt = len(second[0][0])
    assert llm.prefix_cache_stats()["hits"] == (num_prompt - 1) // 4 * 4  # every full block but the last token's
    assert first[0][1] == second[0][1]
    _check(second, [(prompt, [IMAGES[2]])], hf_vl, "prefix hit")
    image_start = second[0][0].index(IMAGE_ID)
    before = llm.prefix_cache_stats()["hits"]
    third = _run(llm, [(prompt, [IMAGES[0]])])
    assert llm.prefix_cache_stats()["hits"] - before == image_start // 4 * 4 > 0
    kv = llm.llm_engine.kv_cache
    # Blocks of computed tokens (all but the last output) of both prompts, the ones before the image shared.
    computed = [len(r[0][0]) + NEW_TOKENS - 1 for r in (second, third)]
    assert kv.num_cached_blocks == computed[0] // 4 + computed[1] // 4 - image_start // 4
    _check(third, [(prompt, [IMAGES[0]])], hf_vl, "other image")


def test_text_prefix_hits_as_on_text_checkpoint(vl_dir: str, vl_llm: LLM) -> None:
    """Text-only prompts on the multimodal checkpoint hit exactly as they would anywhere (vLLM
    #43587: hits fell to 0 with the vision tower loaded)."""
    llm = LLM(vl_dir, dtype="float32", max_model_len=256, block_size=4, state_checkpoint_interval=4)
    text = "The same system prompt, long enough to fill several blocks of four tokens each. "
    llm.generate([text + "First question?"], SamplingParams(temperature=0, max_tokens=2))
    second = llm.generate([text + "Second question?"], SamplingParams(temperature=0, max_tokens=2))[0]
    common = 0
    first_ids = llm.llm_engine.tokenizer.encode(text + "First question?")
    while first_ids[common] == second.prompt_token_ids[common]:
        common += 1
    assert llm.prefix_cache_stats()["hits"] == common // 4 * 4 > 0


def test_mrope_positions_equal_hf_get_rope_index(vl_llm: LLM, hf_vl: HFMultimodalReference) -> None:
    for prompt, images in CASES[:3]:
        mm = vl_llm.llm_engine.process_prompt(_mm_prompt(prompt, images)).mm_inputs
        inputs = hf_vl.inputs(prompt, images)
        pos, delta = hf_vl.model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"])
        assert torch.equal(mm.mrope_positions, pos[:, 0]), prompt
        assert mm.mrope_delta == int(delta[0, 0]) < 0


def test_pixel_values_equal_hf_image_processor(vl_llm: LLM, hf_vl: HFMultimodalReference) -> None:
    """Pixels and grids equal HF's image processor configured from the checkpoint's
    preprocessor_config.json (8-pixel patches, 2 x 2 merge, 16x16..64x64 pixels), including a
    resize of a large and a grey image."""
    images = [random_image(5, 200, 90), random_image(6, 9, 9).convert("L"), IMAGES[0]]
    prompt = "".join(IMAGE for _ in images)
    processed = vl_llm.llm_engine.process_prompt(_mm_prompt(prompt, images))
    ids, mm = processed.prompt_token_ids, processed.mm_inputs
    ref = hf_vl.image_processor(images=[im.convert("RGB") for im in images], return_tensors="pt")
    assert [list(x.grid_thw) for x in mm.items] == ref["image_grid_thw"].tolist()
    assert torch.equal(torch.cat([x.pixel_values for x in mm.items]), ref["pixel_values"])
    assert ids == hf_vl.inputs(prompt, images)["input_ids"][0].tolist()
    assert len({x.hash for x in mm.items}) == 3


@pytest.fixture(scope="module")
def limited_llm(vl_dir: str) -> LLM:
    """At most 2 images per prompt and 40,000 pixels per image."""
    return LLM(vl_dir, dtype="float32", max_model_len=256, limit_mm_per_prompt={"image": 2}, max_image_pixels=40000)


def _png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("prompt, data, message", [
    (IMAGE, {"image": []}, "1 image placeholders"),
    ("no placeholder", {"image": [IMAGES[0]]}, "0 image placeholders"),
    (IMAGE, {"image": ["not an image"]}, "image 1 must be a PIL.Image.Image"),
    (IMAGE, {"audio": [IMAGES[0]]}, "unsupported modality .audio."),
    (IMAGE, ["x"], "multi_modal_data must be a dict"),
    (IMAGE * 3, {"image": IMAGES}, "over the limit of 2 per prompt"),
    (IMAGE, {"image": [Image.new("RGB", (300, 300))]}, "over the limit of 40000"),
    (IMAGE, {"image": [Image.open(io.BytesIO(_png_bytes(IMAGES[0])[:200]))]}, "image 1 cannot be decoded"),
])
def test_bad_images_are_refused_with_nothing_queued(limited_llm: LLM, prompt: str, data: object, message: str) -> None:
    llm = limited_llm
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt": "fine"}, {"prompt": prompt, "multi_modal_data": data}],
                     SamplingParams(max_tokens=2))
    assert not llm.llm_engine.requests and llm.llm_engine.kv_cache.num_free_blocks == llm.llm_engine.kv_cache.num_blocks
    out = llm.generate({"prompt": IMAGE, "multi_modal_data": {"image": IMAGES[0]}}, SamplingParams(max_tokens=2))[0]
    assert len(out.outputs[0].token_ids) == 2


def test_text_checkpoint_refuses_images(qwen3_5_moe_dir: str) -> None:
    llm = LLM(qwen3_5_moe_dir, dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="takes no images"):
        llm.generate({"prompt": "x", "multi_modal_data": {"image": [IMAGES[0]]}})


# A short video: 5 frames of 40 x 48 at 2 fps: resized to 32 x 48 (smart_resize rounds 2.5 to 2), padded to
# 6 frames: 3 frame groups of 2 x 3 tokens.
VIDEO_FRAMES = (np.random.RandomState(7).rand(5, 40, 48, 3) * 255).astype(np.uint8)
VIDEO_CASE = (f"Watch {VIDEO} and then look at {IMAGE}: what happens?", {"video": [(VIDEO_FRAMES, {"fps": 2.0})],
                                                                       "image": [IMAGES[0]]})


def _hf_video_inputs(llm: LLM, prompt: str, data: dict) -> list[tuple]:
    """The (frames, fps, pixel rows, grid) HF's reference needs, pixels from moestream."""
    mm = llm.llm_engine.process_prompt({"prompt": prompt, "multi_modal_data": data}).mm_inputs
    groups = [x for x in mm.items if x.modality == "video"]
    frames, meta = data["video"][0]
    return [(frames, meta["fps"], torch.cat([x.pixel_values for x in groups]),
             [len(groups), *groups[0].grid_thw[1:]])]


@pytest.mark.parametrize("chunked", [False, True])
def test_video_and_image_match_hf(vl_dir: str, vl_llm: LLM, hf_vl: HFMultimodalReference, chunked: bool) -> None:
    """A video and an image in one prompt, batched with a text prompt (and with a 4-token step
    budget that splits every frame group): the expanded prompt (timestamps, nested vision
    tokens) equals HF's processor rules, tokens and logits equal HF's."""
    llm = LLM(vl_dir, dtype="float32", max_model_len=256, max_num_batched_tokens=4) if chunked else vl_llm
    prompt, data = VIDEO_CASE
    videos = _hf_video_inputs(llm, prompt, data)
    recs = [LogitsRecorder(), LogitsRecorder()]
    outs = llm.generate([{"prompt": prompt, "multi_modal_data": data}, {"prompt": CASES[3][0]}],
                        [greedy_params(r, NEW_TOKENS) for r in recs])
    ref_ids, ref_tokens, ref_logits = hf_vl.generate(prompt, [IMAGES[0]], videos)
    assert outs[0].prompt_token_ids == ref_ids
    assert ref_ids.count(VIDEO_ID) == 3 * 6 and hf_vl.tokenizer.decode(ref_ids).count(" seconds>") == 3
    report = ParityReport()
    check_parity(outs[0].outputs[0].token_ids, recs[0].logits, ref_tokens, ref_logits, report, "video")
    _check([(outs[1].prompt_token_ids, outs[1].outputs[0].token_ids, recs[1])], [CASES[3]], hf_vl, "text beside video")
    inputs = hf_vl.inputs(prompt, [IMAGES[0]], videos)
    pos, delta = hf_vl.model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                 image_grid_thw=inputs["image_grid_thw"],
                                                 video_grid_thw=inputs["video_grid_thw"])
    mm = llm.llm_engine.process_prompt({"prompt": prompt, "multi_modal_data": data}).mm_inputs
    assert torch.equal(mm.mrope_positions, pos[:, 0]) and mm.mrope_delta == int(delta[0, 0])


def test_video_layout_and_timestamps_equal_hf() -> None:
    """The patch layout and the frame-group timestamps are HF's (`Qwen3VLVideoProcessor.patchify`,
    `Qwen3VLProcessor._calculate_timestamps`, which run without torchvision)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from moestream.multimodal.processor import patchify_video, video_timestamps

    clip = torch.randn(6, 3, 32, 48)
    ours, grid = patchify_video(clip, 8, 2, 2)
    ref, t, h, w = Qwen3VLVideoProcessor.patchify(None, clip[None], patch_size=8, merge_size=2, temporal_patch_size=2)
    assert grid == (t, h, w) == (3, 4, 6) and torch.equal(ours, ref[0])
    for idx, fps in (([0, 3, 6, 9, 12], 2.0), ([0, 1, 2, 3], 24.0)):
        assert video_timestamps(idx, fps, 2) == Qwen3VLProcessor._calculate_timestamps(None, list(idx), fps, 2)


@pytest.mark.parametrize("video, message", [
    (np.zeros((4, 8, 8), np.uint8), "must be a uint8 array"),
    (np.zeros((4, 8, 8, 3), np.float32), "must be a uint8 array"),
    (np.zeros((1, 32, 32, 3), np.uint8), "has 1 frames; give 2 to 768"),
    ((np.zeros((4, 32, 32, 3), np.uint8), {"fps": -1}), "fps > 0"),
    ([IMAGES[0], "frame"], "must be a uint8 array"),
])
def test_bad_videos_are_refused(vl_llm: LLM, video: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        vl_llm.generate({"prompt": VIDEO, "multi_modal_data": {"video": [video]}}, SamplingParams(max_tokens=2))
    assert not vl_llm.llm_engine.requests


def test_exact_under_preemption_paging_and_speculation(vl_dir: str, vl_llm: LLM) -> None:
    """Image and video prompts give the same greedy tokens under a 25% expert budget with a KV
    cache too small for all of them (preempted and recomputed: encoded again, the rope delta
    kept), and with speculative decoding (drafts right for 0-3 positions, verified at positions
    p + rope delta)."""
    cases = [_mm_prompt(p, ims) for p, ims in CASES] + [{"prompt": VIDEO_CASE[0], "multi_modal_data": VIDEO_CASE[1]}]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in vl_llm.generate(cases, params)]
    small = LLM(vl_dir, dtype="float32", max_model_len=128, block_size=8, expert_budget=0.25,
                kv_cache_memory_bytes=16 * vl_llm.llm_engine.kv_cache_block_bytes // 2)
    assert [o.outputs[0].token_ids for o in small.generate(cases, params)] == want
    assert small.llm_engine.scheduler.num_preemptions > 0 and small.expert_stats()["misses"] > 0
    assert small.llm_engine.kv_cache.num_free_blocks == small.llm_engine.kv_cache.num_blocks
    spec = LLM(vl_dir, dtype="float32", max_model_len=256,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    prompts = [o.prompt_token_ids for o in vl_llm.generate(cases, SamplingParams(max_tokens=1))]
    engine = spec.llm_engine
    engine.proposer = ScriptedProposer(list(zip(prompts, want)), lambda i, n: (i + n) % 4, engine.model_config.vocab_size)
    assert [o.outputs[0].token_ids for o in spec.generate(cases, params)] == want
    assert spec.spec_decode_stats()["num_accepted_tokens"] > 0
