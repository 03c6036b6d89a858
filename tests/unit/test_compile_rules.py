"""--compile's rules and bookkeeping in one process (zerotrain/model/compile.py): the layouts it cannot carry are
refused in one line, ZeRO-3 leaf blocks are forced on (no DeepSpeed hook inside a compiled block) and refused off,
its settings mean nothing without it, the data decides static or dynamic shapes, the blocks share one graph and
CompileWatch counts a recompile. The runs on 2 ranks: tests/multirank/test_compile.py."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from zerotrain.config.load import build_config
from zerotrain.errors import UserError
from zerotrain.model.compile import CompilePlan, CompileWatch, compile_blocks
from zerotrain.model.facts import model_facts, transformer_blocks
from zerotrain.plan.run_plan import build_plan


def _plan(backend: str = "deepspeed", facts=None, **settings):
    cfg = build_config(overrides={"compile.enabled": True, "backend": backend,
                                  **{k.replace("__", "."): v for k, v in settings.items()}})
    return build_plan(cfg, 4, backend=backend, device="cpu", facts=facts or model_facts("tiny-llama"))


@pytest.mark.parametrize("dim", ["tp", "pp", "sp", "ep"])
def test_layouts_that_split_the_blocks_are_refused_in_one_line(dim):
    with pytest.raises(UserError) as e:
        _plan("fsdp", **{f"parallel__{dim}": 2})
    assert f"compile.enabled with --{dim} 2: not supported yet" in str(e.value) and "\n" not in str(e.value), e.value


def test_zero3_leaf_blocks_are_forced_on_and_refused_off():
    unmeasured = replace(model_facts("tiny-llama"), model_type="mistral")  # auto would leave leaf blocks off
    plan = _plan(facts=unmeasured, zero__stage=3)
    assert plan.sharding.leaf_blocks == unmeasured.block_classes
    assert "--compile compiles each block" in plan.sharding.leaf_blocks_why
    with pytest.raises(UserError, match=r"^compile.enabled with zero.leaf_blocks: false at ZeRO-3: .*; drop one$"):
        _plan(zero__stage=3, zero__leaf_blocks=False)


def test_its_settings_mean_nothing_without_it():
    cfg = build_config(overrides={"compile.mode": "max-autotune-no-cudagraphs", "backend": "fsdp"})
    with pytest.raises(UserError, match=r"compile.mode=.* is a --compile setting; compile.enabled is false"):
        build_plan(cfg, 2, backend="fsdp", device="cpu", facts=model_facts("tiny-llama"))


@pytest.mark.parametrize("settings,dynamic", [
    ({}, False),  # the embedded corpus, packed into seq_len rows
    ({"data.path": "corpus.txt"}, False),
    ({"data.path": "chat.jsonl"}, None),  # auto format: chat or text only known once read: automatic
    ({"data.path": "chat.jsonl", "data.format": "chat"}, True),
    ({"data.path": "x.txt", "data.pack": False}, True),
    ({"data.packing": "separate"}, True),
    ({"model.task": "dpo", "data.path": "pairs.jsonl"}, True),
])
def test_the_data_decides_static_or_dynamic_shapes(settings, dynamic):
    prep = build_plan(build_config(overrides={"compile.enabled": True, **settings}), 2, backend="fsdp",
                      device="cpu", facts=model_facts("tiny-llama")).preparation
    assert prep.compile == CompilePlan(dynamic=dynamic)


def test_blocks_share_one_graph_and_a_recompile_is_counted():
    """Two GPT-2 blocks compiled (aot_eager) share one graph; a new batch size with static shapes recompiles once
    (CompileWatch's record), the banner line names the blocks."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from zerotrain.assets.demo import TINY_PRESETS
    from zerotrain.model.preparation import ModelPreparation

    torch._dynamo.reset()
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_PRESETS["tiny-gpt2"]))
    plan = CompilePlan(backend="aot_eager")
    assert compile_blocks(model, transformer_blocks(model), plan) == 2
    assert model.config.use_cache is not False  # the exported config keeps generating with a cache
    watch = CompileWatch()
    x = torch.randint(0, 1024, (2, 16))
    model(input_ids=x, labels=x).loss.backward()
    first = watch.after(1)
    assert first["new_graphs"] == 1 and not first["recompile"], first
    model(input_ids=x, labels=x).loss.backward()
    assert watch.after(2) is None
    y = torch.randint(0, 1024, (3, 16))
    model(input_ids=y, labels=y).loss.backward()
    again = watch.after(3)
    assert again["recompile"] and again["recompiles"] == 1 and "recompiled 1 graph(s)" in CompileWatch.line(again)
    assert watch.summary()["recompiles"] == 1
    banner = ModelPreparation(compile=plan).banner(model)
    assert banner[-1].startswith("compile: 2 transformer blocks, torch.compile aot_eager (mode default, static")
