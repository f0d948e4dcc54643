"""Tiny random-weight vision-language models, made offline, and one engine run over images and text.

Runs in the multimodal venv (`scripts/multimodal_venv.sh`: vLLM's vision models import torchvision).

- `qwen2_vl`: Qwen2-VL (a ViT with 2x2 patch merging, M-RoPE positions in three sections): an image's
  placeholder count follows its size (`IMAGE_SIZES`: 16 and 48 tokens);
- `llava`: LLaVA 1.5 (a CLIP vision tower, a two-layer projector, a Llama): every image resized to the
  tower's 56x56, 16 placeholder tokens. vLLM loads the tower from `vision_tower.vision_model.*`, which
  transformers 5 saves as `vision_tower.*`: the weights are renamed on saving (`_rename_tower`).

Both with a word-level tokenizer over the vocabulary (`t3` .. `t499`) and the models' special tokens,
saved beside the weights with the image processor, so vLLM builds its processor with no download.

`python tests/vllm_mm_models.py run --model DIR --out FILE [--gaudi-standin]` generates `mm_requests()`
with one engine in this process and writes tokens and logprobs as `vllm_helpers.run_scenario` does.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_helpers as H  # noqa: E402

MODELS = ("qwen2_vl", "llava")
VOCAB = 512
#: The models' special tokens, at the top of the vocabulary.
SPECIAL = {"<|vision_start|>": 500, "<|vision_end|>": 501, "<|image_pad|>": 502, "<|video_pad|>": 503,
           "<image>": 504}
#: (width, height) of the test images; Qwen2-VL: 14-pixel patches merged 2x2, 16 and 48 placeholder tokens.
IMAGE_SIZES = ((112, 112), (224, 168))
#: Blocks of 32 (vLLM's CPU attention takes multiples of 32): the 48-token image spans two.
BLOCK_SIZE = 32
MAX_NUM_BATCHED_TOKENS = 64


def _text(hidden: int = 128) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=H.MAX_MODEL_LEN,
                initializer_range=0.05, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def make_model(name: str, path: str, seed: int = 0) -> str:
    """Save model `name` (one of `MODELS`, float32) with its tokenizer and processor to `path`; returns `path`."""
    import torch
    import transformers as T

    torch.manual_seed(seed)
    if name == "qwen2_vl":
        text = _text()
        text.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]})
        config = T.Qwen2VLConfig(
            text_config=text, vision_config=dict(depth=2, embed_dim=64, hidden_size=128, num_heads=4, mlp_ratio=2,
                                                 patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
            image_token_id=SPECIAL["<|image_pad|>"], video_token_id=SPECIAL["<|video_pad|>"],
            vision_start_token_id=SPECIAL["<|vision_start|>"], vision_end_token_id=SPECIAL["<|vision_end|>"],
            tie_word_embeddings=False)
        model = T.Qwen2VLForConditionalGeneration(config)
    elif name == "llava":
        vision = T.CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    image_size=56, patch_size=14, projection_dim=64)
        config = T.LlavaConfig(vision_config=vision, text_config=T.LlamaConfig(**_text()),
                               image_token_index=SPECIAL["<image>"], vision_feature_layer=-1,
                               vision_feature_select_strategy="default", tie_word_embeddings=False)
        model = T.LlavaForConditionalGeneration(config)
    else:
        raise ValueError(f"model {name!r}: not one of {MODELS}")
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)
    if name == "llava":
        _rename_tower(path)
    _save_processor(name, path)
    return path


def _rename_tower(path: str) -> None:
    """transformers 5 saves LLaVA's tower as `vision_tower.*` (the CLIP transformer itself); vLLM 0.32's
    loader takes the original checkpoints' `vision_tower.vision_model.*` (a `CLIPVisionModel`)."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    prefix, tower = "vision_tower.", "vision_tower.vision_model."
    weights = {tower + k[len(prefix):] if k.startswith(prefix) and not k.startswith(tower) else k: v
               for k, v in load_file(file).items()}
    save_file(weights, file, metadata={"format": "pt"})


def _save_processor(name: str, path: str) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(3, min(SPECIAL.values()))}
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<s>": 1, "</s>": 2, **words, **SPECIAL}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        unk_token="<pad>")
    import transformers as T

    if name == "qwen2_vl":
        processor = T.Qwen2VLProcessor(image_processor=T.Qwen2VLImageProcessor(), tokenizer=tokenizer,
                                       video_processor=T.Qwen2VLVideoProcessor())
    else:
        image = T.CLIPImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
        processor = T.LlavaProcessor(image_processor=image, tokenizer=tokenizer, patch_size=14,
                                     vision_feature_select_strategy="default", image_token="<image>")
    processor.save_pretrained(path)


def image_prompt(name: str) -> str:
    """One image's place in a prompt: the models' placeholder, which vLLM expands to the image's tokens."""
    return "<|vision_start|><|image_pad|><|vision_end|>" if name == "qwen2_vl" else "<image>"


def image_tokens(name: str, size: tuple[int, int]) -> int:
    """Tokens one image of `size` takes in the prompt: Qwen2-VL one per 28x28 pixels (14-pixel patches merged
    2x2) plus its start and end markers; LLaVA the tower's 4x4 patches, whatever the size."""
    return size[0] * size[1] // 28 ** 2 + 2 if name == "qwen2_vl" else 16


def expected_prompt_len(name: str, request: dict) -> int:
    """A request of `mm_requests` as the model's processor should expand it: its words and its images."""
    img = image_prompt(name)
    words = request["text"].replace(img, " ").split()
    return len(words) + sum(image_tokens(name, IMAGE_SIZES[s]) for s, _ in request.get("images", []))


def image_ranges(prompt_token_ids: list[int], name: str) -> list[tuple[int, int]]:
    """[(first, end)] of each image's placeholder tokens in an expanded prompt."""
    import numpy as np

    token = SPECIAL["<|image_pad|>" if name == "qwen2_vl" else "<image>"]
    edges = np.diff(np.concatenate([[0], np.asarray(prompt_token_ids) == token, [0]]).astype(np.int8))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def make_image(size: tuple[int, int], seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def mm_requests(name: str) -> list[list[dict]]:
    """Two waves. Wave 1, together: an image of each size beside text-only prompts, long enough that the
    64-token budget cuts some prompt inside an image's placeholders. Wave 2: the first image request's
    prompt again with another ending (a prefix-cache hit over the image; no prompt logprobs, which would
    turn the cache off for the request), and the same text with another
    image (same placeholder count, other pixels: vLLM's block hashes include the image's hash, so no hit)."""
    import random

    rng = random.Random(5)

    def words(n):
        return " ".join(f"t{rng.randrange(3, 500)}" for _ in range(n))

    img = image_prompt(name)
    shared = f"{words(40)} {img} {words(10)}"  # the image inside the first two 32-token blocks
    wave1 = [
        dict(name="image_small", text=f"{shared} {words(9)}", images=[(0, 11)], max_tokens=8, prompt_logprobs=True),
        dict(name="text_short", text=words(7), max_tokens=10),
        dict(name="image_large", text=f"{words(5)} {img} {words(30)}", images=[(1, 12)], max_tokens=8),
        dict(name="text_long", text=words(90), max_tokens=6, prompt_logprobs=True),
    ]
    wave2 = [
        dict(name="image_small_cached", text=f"{shared} {words(12)}", images=[(0, 11)], max_tokens=8),
        dict(name="image_other_pixels", text=f"{shared} {words(12)}", images=[(0, 13)], max_tokens=8),
        dict(name="two_images", text=f"{words(3)} {img} {words(4)} {img} {words(2)}", images=[(0, 14), (1, 15)],
             max_tokens=6),
    ]
    return [wave1, wave2]


def run(model: str, out: str, gaudi_standin: bool = False) -> None:
    """Both waves with one engine in this process (greedy); tokens, logprobs and the prefix-cache hits."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    device = H.gaudi_standin_context("float32") if gaudi_standin else contextlib.nullcontext()
    with device:
        from vllm import LLM, SamplingParams

        name = "qwen2_vl" if "qwen2_vl" in json.load(open(os.path.join(model, "config.json")))["model_type"] \
            else "llava"
        llm = LLM(model=model, enforce_eager=True, dtype="float32", seed=0, max_model_len=H.MAX_MODEL_LEN,
                  block_size=BLOCK_SIZE, max_num_seqs=H.MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                  enable_chunked_prefill=True, enable_prefix_caching=True, kv_cache_memory_bytes=64 << 20,
                  limit_mm_per_prompt={"image": 2, "video": 0}, mm_processor_cache_gb=0)
        chunks = _record_chunks(llm)
        results = {}
        for wave in mm_requests(name):
            prompts = []
            for r in wave:
                p = {"prompt": r["text"]}
                if r.get("images"):
                    images = [make_image(IMAGE_SIZES[s], seed) for s, seed in r["images"]]
                    p["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
                prompts.append(p)
            params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, logprobs=2, detokenize=False,
                                     prompt_logprobs=1 if r.get("prompt_logprobs") else None, ignore_eos=True)
                      for r in wave]
            for r, o in zip(wave, llm.generate(prompts, params, use_tqdm=False)):
                results[r["name"]] = {
                    "samples": [{"tokens": list(c.token_ids), "logprobs": [H._logprob_dict(e) for e in c.logprobs]}
                                for c in o.outputs],
                    "prompt_logprobs": None if o.prompt_logprobs is None else
                    [None if e is None else H._logprob_dict(e) for e in o.prompt_logprobs],
                    "prompt_len": len(o.prompt_token_ids), "cached_tokens": o.num_cached_tokens,
                    "image_ranges": image_ranges(o.prompt_token_ids, name),
                    "prompt_chunks": [c for c in _chunks_of(chunks, o.request_id) if c[0] < len(o.prompt_token_ids)]}
    with open(out, "w") as f:
        json.dump({"results": results}, f)


def _record_chunks(llm) -> dict:
    """request id -> [(first token, end)] of each step that scheduled it, read from the scheduler's outputs
    (the engine runs in this process): where the token budget cut each prompt."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule, chunks = scheduler.schedule, {}

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        cached = out.scheduled_cached_reqs
        done = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        done.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, n in out.num_scheduled_tokens.items():
            chunks.setdefault(req_id, []).append((done[req_id], done[req_id] + n))
        return out

    scheduler.schedule = recording
    return chunks


def _chunks_of(chunks: dict, request_id: str) -> list:
    """The scheduler's id of an output's request is the output's id with a suffix (`0-1a2b...`)."""
    ids = [k for k in chunks if k == request_id or k.startswith(request_id + "-")]
    assert len(ids) == 1, (request_id, list(chunks))
    return chunks.pop(ids[0])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--gaudi-standin" not in argv:
        H.keep_vllm_gaudi_out()
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make-model", help="save a tiny random model")
    mk.add_argument("name", choices=MODELS)
    mk.add_argument("path")
    rn = sub.add_parser("run", help="generate the image and text requests with one engine")
    rn.add_argument("--model", required=True)
    rn.add_argument("--out", required=True)
    H.add_standin_flag(rn)
    args = parser.parse_args(argv)
    if args.cmd == "make-model":
        make_model(args.name, args.path)
    else:
        run(args.model, args.out, args.gaudi_standin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
