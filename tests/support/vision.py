"""Tiny image-text models and a TRL-format image chat set, built locally (no hub) with the REAL processor classes.

- make_vl_model_dir(family, path): a tiny model of VL_FAMILIES[family] (random weights, dropout 0) saved with
  save_pretrained next to its processor (the PIL image processor, a word-level fast tokenizer holding the family's
  image special tokens, and a chat template), so that AutoModelForImageTextToText.from_pretrained(path) and
  AutoProcessor.from_pretrained(path) load it offline.
    llava:    CLIP vision tower (1 layer, 28x28 images, patch 14: 4 image tokens) + projector + Llama decoder;
              chat template WITHOUT {% generation %} markers (assistant labels by the prefix rule).
    qwen2-vl: Qwen2-VL (1-block vision tower, dynamic resolution: a 28x28 image is resized to 56x56 -> 4 tokens,
              56x84 -> 6 tokens; mrope); chat template WITH {% generation %} markers.
    gemma3:   SigLIP tower (1 layer, 28x28, patch 14) + Gemma 3 decoder, 4 image tokens between boi/eoi;
              chat template without markers.
- make_vl_dataset(path, n_rows, image_dir): JSONL in TRL's vision format: `messages` (user turn = an {"type": "image"}
  part + a text part, assistant turn = a text part) and `images` (one PNG path per row), fixed seed; image sizes vary
  (28x28 / 56x84) so Qwen2-VL's dynamic resolution gives rows different image-token counts.

qwen2-vl needs torchvision: transformers 5.24's Qwen2VLProcessor requires a video processor, and every video
processor class needs torchvision (without it AutoProcessor.from_pretrained silently returns the bare tokenizer). The
only torchvision wheels here are CUDA builds that do not load with the CPU torch ("libtorch_cuda.so not found"), so
unavailable(family) says why and the qwen2-vl cells skip with that reason where torchvision cannot be imported.

Tokenizer: one token per word or punctuation mark (as tests/support/make_pref_data.py), ids < VOCAB.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

VOCAB = 256
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"
IMAGE_SIZES = ((28, 28), (56, 84))
"""(height, width) of the set's images, alternating by row."""

from tests.support.make_pref_data import ANSWER_WORDS, PROMPT_WORDS, PUNCT, ROLES  # noqa: E402

WORDS = list(dict.fromkeys(ROLES + PUNCT + PROMPT_WORDS + ANSWER_WORDS + ["image", "picture", "color", "shape"]))


@dataclass(frozen=True)
class VLFamily:
    name: str
    config: Callable[[dict[str, int]], Any]
    """The HF config, given the tokenizer's special-token ids."""
    image_tokens: tuple[str, ...]
    """Special tokens the processor needs (the first is the placeholder a chat template writes for an image)."""
    processor: Callable[[Any, str], Any]
    """(tokenizer, chat_template) -> the processor."""
    template: str
    markers: bool
    """Whether the chat template has {% generation %} markers."""


def _chat_template(image: str, markers: bool, bos: bool) -> str:
    """A chat template over TRL's content parts: an image part writes `image`, a text part its text; the assistant's
    content and its end token inside {% generation %} when markers."""
    gen_open, gen_close = ("{% generation %}", "{% endgeneration %}") if markers else ("", "")
    parts = ("{% if message['content'] is string %}{{ message['content'] }}{% else %}"
             "{% for part in message['content'] %}{% if part['type'] == 'image' %}" + image + " "
             "{% elif part['type'] == 'text' %}{{ part['text'] }} {% endif %}{% endfor %}{% endif %}")
    return (("{{ bos_token }}" if bos else "")
            + "{% for message in messages %}" + TURN_START + " {{ message['role'] }} "
            + "{% if message['role'] == 'assistant' %}" + gen_open + parts + TURN_END + gen_close + " "
            + "{% else %}" + parts + TURN_END + " {% endif %}{% endfor %}"
            + "{% if add_generation_prompt %}" + TURN_START + " assistant {% endif %}")


def _ids(names: tuple[str, ...]) -> dict[str, int]:
    return {t: i for i, t in enumerate((PAD, BOS, EOS, UNK, TURN_START, TURN_END) + names)}


def _llava_config(ids: dict[str, int]):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    text = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256,
                       tie_word_embeddings=False, bos_token_id=ids[BOS], eos_token_id=ids[EOS],
                       pad_token_id=ids[PAD])
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=28, patch_size=14, projection_dim=32, attention_dropout=0.0)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=ids["<image>"],
                       vision_feature_select_strategy="default", vision_feature_layer=-1,
                       projector_hidden_act="gelu", tie_word_embeddings=False)


def _llava_processor(tokenizer, template: str):
    from transformers import LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    images = LlavaImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=template, image_token="<image>")


def _qwen2_vl_config(ids: dict[str, int]):
    from transformers import Qwen2VLConfig

    # head_dim 16: mrope sections sum to head_dim / 2
    text = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD], attention_dropout=0.0)
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    return Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                         video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                         vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)


def _qwen2_vl_processor(tokenizer, template: str):
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    # min 56x56, max 56x112 pixels: 16-32 patches of 14x14, 4-8 image tokens after the 2x2 merge
    images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 112, patch_size=14, merge_size=2,
                                      temporal_patch_size=2)
    return Qwen2VLProcessor(image_processor=images, tokenizer=tokenizer, chat_template=template)


GEMMA3_IMAGE_TOKENS = 4


def _gemma3_config(ids: dict[str, int]):
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256,
                            sliding_window=16, query_pre_attn_scalar=16, bos_token_id=ids[BOS],
                            eos_token_id=ids[EOS], pad_token_id=ids[PAD], attention_dropout=0.0)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14, attention_dropout=0.0, vision_use_head=False)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
                        boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                        image_token_index=ids["<image_soft_token>"], tie_word_embeddings=True)


def _gemma3_processor(tokenizer, template: str):
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    images = Gemma3ImageProcessorPil(size={"height": 28, "width": 28}, do_pan_and_scan=False)
    return Gemma3Processor(image_processor=images, tokenizer=tokenizer, chat_template=template,
                           image_seq_length=GEMMA3_IMAGE_TOKENS)


VL_FAMILIES: dict[str, VLFamily] = {
    "llava": VLFamily("llava", _llava_config, ("<image>",), _llava_processor,
                      _chat_template("<image>", markers=False, bos=True), markers=False),
    "qwen2-vl": VLFamily("qwen2-vl", _qwen2_vl_config,
                         ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"),
                         _qwen2_vl_processor,
                         _chat_template("<|vision_start|><|image_pad|><|vision_end|>", markers=True, bos=False),
                         markers=True),
    "gemma3": VLFamily("gemma3", _gemma3_config, ("<start_of_image>", "<end_of_image>", "<image_soft_token>"),
                       _gemma3_processor, _chat_template("<start_of_image>", markers=False, bos=True),
                       markers=False),
}


def unavailable(family: str) -> str | None:
    """Why `family` cannot be built on this machine (None if it can)."""
    if family != "qwen2-vl":
        return None
    try:
        import torchvision  # noqa: F401
    except Exception as e:  # a CUDA-only wheel next to a CPU torch raises RuntimeError / OSError, not ImportError
        return f"qwen2-vl's processor needs torchvision (Qwen2VLProcessor requires a video processor): {e}"
    return None


def vl_tokenizer(family: str):
    """The word-level fast tokenizer of `family` (its image and turn tokens special; no BOS added on encode: the
    llava / gemma3 chat templates write it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    spec = VL_FAMILIES[family]
    ids = _ids(spec.image_tokens)
    vocab = dict(ids)
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    assert len(vocab) <= VOCAB, len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(ids))  # matched whole before the word split
    extra: dict[str, str] = {}
    if family == "llava":
        extra = {"image_token": "<image>"}
    elif family == "qwen2-vl":
        extra = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                 "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"}
    elif family == "gemma3":
        extra = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK,
                                   pad_token=PAD, additional_special_tokens=[TURN_START, TURN_END],
                                   extra_special_tokens=extra)
    for name, token in extra.items():  # the processors read tokenizer.<name> / tokenizer.<name>_id
        assert getattr(fast, name) == token and getattr(fast, name + "_id") == ids[token], name
    return fast


def make_vl_model_dir(family: str, path: str | Path, seed: int = 0, text: dict | None = None) -> Path:
    """A tiny `family` model (VL_FAMILIES) with random weights (torch seed `seed`) saved with its processor in `path`;
    text: sizes of its language model instead of the tiny ones (e.g. small-llama's, for a memory check)."""
    from transformers import AutoModelForImageTextToText

    spec = VL_FAMILIES[family]
    if (why := unavailable(family)) is not None:
        raise RuntimeError(why)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = vl_tokenizer(family)
    config = spec.config(_ids(spec.image_tokens))
    for k, v in (text or {}).items():
        setattr(config.text_config, k, v)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    model.save_pretrained(str(path))
    spec.processor(tokenizer, spec.template).save_pretrained(str(path))
    return path


def save_without_processor(family: str, path: str | Path, seed: int = 0) -> Path:
    """The model, its tokenizer (with the chat template) and its image processor saved apart, no processor files:
    what a directory looks like when the processor class cannot be built (qwen2-vl without torchvision)."""
    from transformers import AutoModelForImageTextToText

    spec = VL_FAMILIES[family]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = vl_tokenizer(family)
    tokenizer.chat_template = spec.template
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(spec.config(_ids(spec.image_tokens))).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    if family == "qwen2-vl":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 112).save_pretrained(str(path))
    return path


def _image(rng: random.Random, size: tuple[int, int]):
    """A PIL RGB image: a random background with a random rectangle (deterministic from rng)."""
    from PIL import Image, ImageDraw

    h, w = size
    img = Image.new("RGB", (w, h), tuple(rng.randrange(256) for _ in range(3)))
    x0, y0 = rng.randrange(w // 2), rng.randrange(h // 2)
    ImageDraw.Draw(img).rectangle([x0, y0, x0 + rng.randrange(4, w // 2), y0 + rng.randrange(4, h // 2)],
                                  fill=tuple(rng.randrange(256) for _ in range(3)))
    return img


def vl_rows(n_rows: int, image_dir: str | Path, seed: int = 0) -> list[dict]:
    """n_rows TRL-format rows, their PNGs written under image_dir (row i: image_dir/img_{i}.png)."""
    rng = random.Random(seed)
    image_dir = Path(image_dir)
    image_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n_rows):
        png = image_dir / f"img_{i}.png"
        _image(rng, IMAGE_SIZES[i % len(IMAGE_SIZES)]).save(png)
        question = " ".join(rng.choice(PROMPT_WORDS) for _ in range(rng.randint(3, 8))) + " ?"
        answer = " ".join(rng.choice(ANSWER_WORDS) for _ in range(rng.randint(2, 7))) + " ."
        rows.append({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
                                  {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
                     "images": [str(png)]})
    return rows


def make_vl_dataset(path: str | Path, n_rows: int, image_dir: str | Path, seed: int = 0) -> Path:
    """Write vl_rows(n_rows, image_dir, seed) as JSONL at `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in vl_rows(n_rows, image_dir, seed)))
    return path


def reference_loss(model_dir: str | Path, rows: list[dict]) -> float:
    """The mean next-token loss of `rows` (TRL-format, every row one batch) computed without zerotrain: the processor's
    own call on the chats its template renders and the decoded images, labels = every token after the last
    `<|im_start|> assistant` header (the answer and its end token; the image tokens all precede it),
    AutoModelForImageTextToText.from_pretrained's loss."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    proc = AutoProcessor.from_pretrained(str(model_dir))
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
    texts = [proc.apply_chat_template(r["messages"], tokenize=False) for r in rows]
    images = [[Image.open(p).convert("RGB") for p in r["images"]] for r in rows]
    batch = proc(text=texts, images=images, padding=True, padding_side="right", add_special_tokens=False,
                 return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    start, assistant = proc.tokenizer.convert_tokens_to_ids([TURN_START, "assistant"])
    labels = torch.full_like(ids, -100)
    for i in range(len(rows)):
        n = int(mask[i].sum())
        header = max(j for j in range(n - 1) if ids[i, j] == start and ids[i, j + 1] == assistant)
        labels[i, header + 2:n] = ids[i, header + 2:n]
    with torch.no_grad():
        return model(**batch, labels=labels).loss.item()
