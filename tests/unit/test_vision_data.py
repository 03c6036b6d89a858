"""Image-text models (issue 55) in one process: the task an image-text config resolves to, chats with images in TRL's
vision format -> the processor's tokens and assistant-only labels (zerotrain/data/vision.py), the whole set's loss
against an independent computation with the processor and the plain HF model, truncation around images, and the
one-line refusals. Tiny models of tests/support/vision.py (LLaVA, Gemma 3; Qwen2-VL where torchvision loads)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.vision import VL_FAMILIES, make_vl_dataset, make_vl_model_dir, reference_loss, unavailable, \
    vl_rows
from zerotrain.config.load import build_config
from zerotrain.errors import ConfigError, UserError

FAMILIES = [f for f in VL_FAMILIES if unavailable(f) is None]
"""The families this machine builds: qwen2-vl's processor needs torchvision, which does not load here (CUDA-only
wheels next to a CPU torch); test_qwen2_vl_without_its_processor_is_refused runs either way."""


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    built = {}

    def get(family: str):
        if family not in built:
            built[family] = make_vl_model_dir(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


def _prepared(model, data, **overrides):
    """(the resolved config, its ModelSource, its PreparedData) as train's preflight makes them."""
    from zerotrain.data.datasets import prepare_data
    from zerotrain.model.source import resolve_model

    cfg = build_config(overrides={"model.name": str(model), "data.path": str(data), "data.seq_len": 64, **overrides})
    source = resolve_model(cfg)
    return cfg, source, prepare_data(cfg, source.tokenizer, processor=source.processor, task=source.task)


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_set_loss_equals_the_processor_and_plain_model(tmp_path, model_dir, family):
    """The collated batch of the whole set through the model zerotrain builds gives the loss of an independent
    computation (the processor's own call on the rendered chats and decoded images, labels from the token ids,
    AutoModelForImageTextToText.from_pretrained) to 1e-5."""
    model = model_dir(family)
    data = make_vl_dataset(tmp_path / "d.jsonl", 6, tmp_path / "img")
    cfg, source, prepared = _prepared(model, data)
    assert source.task.name == "image-text" and type(source.processor).__name__.endswith("Processor")
    assert "task image-text (AutoModelForImageTextToText" in source.description
    batch = prepared.collate([prepared.train[i] for i in range(len(prepared.train))])
    built = source.factory(seed=0)()
    ours = built(**batch).loss.item()
    ref = reference_loss(model, [json.loads(x) for x in data.read_text().splitlines()])
    assert ours == pytest.approx(ref, rel=1e-5), (ours, ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_labels_are_the_answer_and_never_an_image_token(tmp_path, model_dir, family):
    model = model_dir(family)
    data = make_vl_dataset(tmp_path / "d.jsonl", 4, tmp_path / "img")
    _, source, prepared = _prepared(model, data)
    tok, proc = source.tokenizer, source.processor
    rows = vl_rows(4, tmp_path / "img2")
    image_ids = {tok.convert_tokens_to_ids(t) for t in VL_FAMILIES[family].image_tokens}
    for i, r in enumerate(prepared.train):
        labelled = [t for t in r["labels"] if t != -100]
        answer = rows[i]["messages"][1]["content"][0]["text"]
        assert tok.decode(labelled) == answer + " <|im_end|>", (tok.decode(labelled), answer)
        assert not image_ids & set(labelled)
        n_image = sum(t == getattr(proc, "image_token_id", None) or t in image_ids for t in r["input_ids"])
        assert n_image >= 4  # every image's tokens are in the ids (LLaVA / Gemma 3: 4 soft tokens, + boi/eoi)
    batch = prepared.collate([prepared.train[0], prepared.train[1]])
    assert batch["pixel_values"].shape[0] >= 1 and batch["input_ids"].shape == batch["labels"].shape
    if family == "gemma3":  # its image tokens attend bidirectionally: the processor's token_type_ids reach the model
        assert batch["token_type_ids"].sum() == 2 * 4


def test_truncation_never_cuts_through_an_image(tmp_path, model_dir):
    """--truncation truncate cuts after the image, or drops the sample (counted) when the cut would split the
    image's tokens; --truncation drop drops every long sample."""
    model = model_dir("llava")
    rows = vl_rows(6, tmp_path / "img")
    for r in rows:  # ten words before the image: its 4 tokens sit at positions 13-16
        r["messages"][0]["content"].insert(0, {"type": "text", "text": "tell me about the red house near the old river"})
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, _, full = _prepared(model, data)
    lengths = [len(x) for x in full.train["input_ids"]]
    image_at = [i for i, t in enumerate(full.train[0]["input_ids"]) if t == 6]  # <image>: id 6 (support/vision.py)
    assert image_at == [13, 14, 15, 16] and min(lengths) > 24
    with pytest.raises(UserError, match=r"0 samples \(0 truncated, 0 dropped at --seq-len 15, 6 dropped because the "
                                        r"cut would split an image's tokens\)"):
        _prepared(model, data, **{"data.seq_len": 15, "data.truncation": "truncate"})
    seq = min(lengths) - 1  # after every image, before every row's end
    _, _, kept = _prepared(model, data, **{"data.seq_len": seq, "data.truncation": "truncate"})
    assert len(kept.train) == 6 and all(len(x) == seq for x in kept.train["input_ids"])
    assert "6 samples (6 truncated, 0 dropped" in kept.description
    with pytest.raises(UserError, match=r"0 samples \(0 truncated, 6 dropped at --seq-len"):
        _prepared(model, data, **{"data.seq_len": seq, "data.truncation": "drop"})
    longest = max(lengths)
    _, _, some = _prepared(model, data, **{"data.seq_len": longest - 1, "data.truncation": "drop"})
    assert 0 < len(some.train) < 6 and all(len(x) < longest for x in some.train["input_ids"])


def _no_image(row: dict, img: Path) -> None:
    row["images"] = []
    for m in row["messages"]:
        if isinstance(m["content"], list):
            m["content"] = [p for p in m["content"] if p.get("type") != "image"]


@pytest.mark.parametrize("spoil,line", [
    (lambda row, img: row.update(images=[str(img / "missing.png")]), r"^--data row 2: image .*missing.png does not exist"),
    # a rank whose micro-batch held no image would skip the tower's sharded collectives: refused, not hung
    (_no_image, r"^--data row 2: no image part in its messages; a micro-batch without an image skips the image "
                r"tower, whose sharded parameters \(ZeRO-3, FSDP2\) every rank must gather together, so the run would "
                r"hang; give every chat an image, or drop the text-only rows$"),
], ids=["missing-image", "no-image"])
def test_a_bad_row_is_refused_naming_it(tmp_path, model_dir, spoil, line):
    rows = vl_rows(3, tmp_path / "img")
    spoil(rows[1], tmp_path / "img")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError, match=line) as e:
        _prepared(model_dir("llava"), data)
    assert "\n" not in str(e.value)


def test_relative_image_paths_are_read_from_the_data_files_folder(tmp_path, model_dir):
    rows = vl_rows(2, tmp_path / "img")
    for r in rows:
        r["images"] = [f"img/{r['images'][0].rsplit('/', 1)[1]}"]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, _, prepared = _prepared(model_dir("llava"), data)
    assert all(p.startswith(str(tmp_path)) for r in prepared.train["images"] for p in r)


def test_refusals_in_one_line(tmp_path, model_dir):
    from tests.support.families import make_model_dir
    from tests.support.make_pref_data import tiny_tokenizer
    from zerotrain.model.source import resolve_model
    from zerotrain.tasks import task_for_model

    model = model_dir("llava")
    data = make_vl_dataset(tmp_path / "d.jsonl", 2, tmp_path / "img")
    cases = [
        ({"data.packing": "separate"}, UserError, r"^--packing separate with an image-text model"),
        ({"data.data_weights": "1"}, UserError, r"^--data-weights 1 with an image-text model"),
        ({"data.format": "text"}, UserError, r"^--data-format text with an image-text model"),
    ]
    for overrides, error, match in cases:
        with pytest.raises(error, match=match) as e:
            _prepared(model, data, **overrides)
        assert "\n" not in str(e.value)
    for task in ("dpo", "seq-cls", "grpo"):  # tasks an image-text model cannot take
        with pytest.raises(ConfigError, match=rf"^--task {task}: the model is an image-text model \(LlavaConfig\)"):
            resolve_model(build_config(overrides={"model.name": str(model), "model.task": task}))
    text_model = make_model_dir("llama", tmp_path / "llama")
    tiny_tokenizer(add_bos=True).save_pretrained(str(text_model))
    assert resolve_model(build_config(overrides={"model.name": str(text_model)})).task.name == "causal-lm"
    # --task does not take image-text: the config keeps the asked task, the run's plan holds the resolved one
    with pytest.raises(ConfigError, match=r"^config 'model.task': "):
        build_config(overrides={"model.task": "image-text"})
    with pytest.raises(ConfigError, match=r"^model.task=image-text: the model is not an image-text model"):
        task_for_model("image-text", resolve_model(build_config(overrides={"model.name": str(text_model)})).hf_config)
    bare = tmp_path / "bare"  # the weights and the tokenizer, no processor files
    import shutil

    shutil.copytree(model, bare)
    (bare / "processor_config.json").unlink()
    with pytest.raises(UserError, match=r"an image-text model without a processor \(AutoProcessor: Can't load image "
                                        r"processor .*; save its processor into the directory"):
        resolve_model(build_config(overrides={"model.name": str(bare)}))
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "yes"}]}) + "\n")
    with pytest.raises(UserError, match=r"no column 'images'"):
        _prepared(model, plain)


def test_qwen2_vl_without_its_processor_is_refused(tmp_path):
    """Qwen2-VL's processor needs torchvision (its video processor); without it AutoProcessor returns the bare
    tokenizer, which zerotrain refuses in one line naming the fix; with it the processor loads."""
    from tests.support.vision import save_without_processor
    from zerotrain.model.source import resolve_model

    if unavailable("qwen2-vl") is None:
        source = resolve_model(build_config(overrides={"model.name": str(make_vl_model_dir("qwen2-vl", tmp_path / "q"))}))
        assert type(source.processor).__name__ == "Qwen2VLProcessor" and source.task.name == "image-text"
        return
    bare = save_without_processor("qwen2-vl", tmp_path / "q")
    with pytest.raises(UserError, match=r"an image-text model without a processor .* \(e.g. torchvision for "
                                        r"Qwen2-VL\)$") as e:
        resolve_model(build_config(overrides={"model.name": str(bare)}))
    assert "\n" not in str(e.value)


def test_the_preflight_refuses_features_the_entry_does_not_compose_with(tmp_path, model_dir, monkeypatch):
    """The resolved config is checked again (config/rules.py, plan/parallel_rules.py): --streaming, QAT, the tiled
    MLP and --sp (on a 2-rank world's rank 0, before any process group) name the image-text task."""
    from zerotrain.train.preflight import preflight

    model = model_dir("llava")
    data = make_vl_dataset(tmp_path / "d.jsonl", 2, tmp_path / "img")
    base = {"model.name": str(model), "data.path": str(data), "run.output": str(tmp_path / "out")}
    with pytest.raises(ConfigError, match=r"--streaming with --task image-text"):
        preflight(build_config(overrides={**base, "data.streaming": True, "run.max_steps": 2}))
    with pytest.raises(ConfigError, match=r"^--qat int4-weight: quantized export is for causal LMs \(task image-text\); "
                                          r"pass --qat none$"):
        preflight(build_config(overrides={**base, "quant.qat": "int4-weight"}))
    with pytest.raises(ConfigError, match=r"^model.tiled_mlp with --task image-text: the task does not run with it"):
        preflight(build_config(overrides={**base, "model.tiled_mlp": 64}))
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(UserError, match=r"^--sp 2 needs a causal-lm model \(got model.task=image-text\)"):
        preflight(build_config(overrides={**base, "parallel.sp": 2, "backend": "fsdp"}))


def test_preflight_resolves_the_task_and_the_run_config_records_the_asked_one(tmp_path, model_dir):
    from zerotrain.config.load import to_yaml
    from zerotrain.train.preflight import preflight

    model = model_dir("gemma3")
    data = make_vl_dataset(tmp_path / "d.jsonl", 4, tmp_path / "img")
    setup = preflight(build_config(overrides={"model.name": str(model), "data.path": str(data),
                                              "run.output": str(tmp_path / "out"), "run.max_steps": 1}))
    assert setup.plan.task.name == "image-text" and setup.cfg.model.task == "causal-lm"
    assert setup.plan.facts.block_classes == (
        "SiglipEncoderLayer", "Gemma3DecoderLayer")  # the tower's blocks too: ZeRO-3 leaf units
    written = tmp_path / "run_config.yaml"
    written.write_text(to_yaml(setup.cfg))
    assert "task: causal-lm" in written.read_text() and build_config(written).model.task == "causal-lm"


def test_llava_zero3_leaf_blocks_leave_out_the_tower_whose_hidden_states_it_reads(model_dir):
    """LLaVA reads its image features from the tower's recorded hidden states (vision_feature_layer), which bypass a
    leaf module's backward hook: the decoder's blocks alone become leaves (the 2-rank run:
    tests/multirank/test_vision_roles.py, the LoRA CI cell)."""
    from zerotrain.model.source import model_facts_for
    from zerotrain.plan.run_plan import leaf_blocks

    facts = model_facts_for(build_config(overrides={"model.name": str(model_dir("llava"))}))
    assert leaf_blocks(True, facts) == (("LlamaDecoderLayer",), "on (LlamaDecoderLayer): zero.leaf_blocks: true")


def test_data_prepare_refuses_an_image_text_model(tmp_path, model_dir, capsys):
    from zerotrain.cli import main

    data = make_vl_dataset(tmp_path / "d.jsonl", 2, tmp_path / "img")
    code = main(["data", "prepare", "--model", str(model_dir("llava")), "--data", str(data), "--output",
                 str(tmp_path / "prep")])
    assert code != 0 and not (tmp_path / "prep" / "manifest.json").exists()
    assert "an image-text model; its chats with images are tokenized when `zerotrain train` starts" in \
        capsys.readouterr().err


def test_an_image_text_config_is_recognised_by_transformers_mappings():
    from transformers import Gemma3TextConfig, LlamaConfig, LlavaConfig

    from zerotrain.tasks import image_text, task_for_model

    assert image_text(LlavaConfig()) and not image_text(LlamaConfig()) and not image_text(Gemma3TextConfig())
    assert task_for_model("causal-lm", LlavaConfig()).auto_class == "AutoModelForImageTextToText"
    assert task_for_model("causal-lm", LlamaConfig()).name == "causal-lm"
    assert task_for_model("causal-lm", None).name == "causal-lm"


def test_the_processor_is_exported_from_a_checkpoint_dir(tmp_path, model_dir):
    """checkpoint/store.py write_tokenizer: a checkpoint holding a processor exports it whole (AutoProcessor)."""
    from transformers import AutoProcessor

    from zerotrain.checkpoint.store import write_tokenizer

    out = tmp_path / "out"
    out.mkdir()
    write_tokenizer(out, model_dir("gemma3"))
    proc = AutoProcessor.from_pretrained(out)
    assert type(proc).__name__ == "Gemma3Processor" and proc.chat_template
    assert torch.is_tensor(proc(text=["<start_of_image> hi"], images=[[_blank()]], return_tensors="pt")["pixel_values"])


def _blank():
    from PIL import Image

    return Image.new("RGB", (28, 28))
