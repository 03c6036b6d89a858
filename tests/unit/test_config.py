"""Run config + DeepSpeed config generator: every valid combination is accepted by DeepSpeed's own
parser, every invalid one is refused by ours with one line naming the setting and the fix."""
import itertools
import subprocess
import sys

import pytest

from tests.support.launch import REPO, rank_env
from zerotrain.config.load import ConfigError, build_config, to_yaml
from zerotrain.config.schema import RunConfig
from zerotrain.model.facts import ModelFacts
from zerotrain.plan.ds_config import build_ds_config
from zerotrain.plan.parallel_rules import check_backend, resolve_batch
from zerotrain.plan.run_plan import bucket_sizes

STAGES = [0, 1, 2, 3]
OFFLOAD = ["none", "cpu", "nvme"]
PRECISION = ["fp32", "bf16", "fp16"]


def _overrides(stage, opt, param, prec):
    o = {"zero.stage": stage, "zero.offload_optimizer": opt, "zero.offload_param": param, "precision.dtype": prec}
    if "nvme" in (opt, param):
        o["zero.nvme_path"] = "/local_nvme"
    return o


def _expected_error(stage, opt, param):
    if param != "none" and stage != 3:
        return "zero.offload_param"
    if opt != "none" and stage == 0:
        return "zero.offload_optimizer"
    return None


@pytest.mark.parametrize("stage,opt,param,prec", list(itertools.product(STAGES, OFFLOAD, OFFLOAD, PRECISION)))
def test_every_combination(stage, opt, param, prec):
    overrides = _overrides(stage, opt, param, prec)
    bad = _expected_error(stage, opt, param)
    if bad:
        with pytest.raises(ConfigError, match=bad) as e:
            build_config(None, overrides)
        assert "\n" not in str(e.value)
        return
    cfg = build_config(None, overrides)
    ds = build_ds_config(cfg, world_size=1, total_steps=10)
    from deepspeed.runtime.config import DeepSpeedConfig  # only this test needs DeepSpeed (the extra installs it)

    parsed = DeepSpeedConfig(ds)  # DeepSpeed's own parser (its zero section forbids unknown keys)
    z = parsed.zero_config
    assert parsed.zero_optimization_stage == stage
    assert parsed.train_micro_batch_size_per_gpu == cfg.batch.micro_batch
    assert parsed.gradient_accumulation_steps == cfg.batch.grad_accum
    assert (str(getattr(z.offload_optimizer.device, "value", z.offload_optimizer.device)) if z.offload_optimizer else "none") == opt
    assert (str(getattr(z.offload_param.device, "value", z.offload_param.device)) if z.offload_param else "none") == param
    assert parsed.bfloat16_config.enabled == (prec == "bf16")
    assert parsed.float16_config.enabled == (prec == "fp16")
    assert "auto" not in str(ds)
    if stage >= 1:
        assert z.reduce_bucket_size == ds["zero_optimization"]["reduce_bucket_size"] < 5e8
    if stage == 3:
        assert z.gather_16bit_weights_on_model_save
        assert z.param_persistence_threshold == ds["zero_optimization"]["stage3_param_persistence_threshold"]
    if opt != "none":
        assert ds["optimizer"]["type"] in ("AdamW", "Adam")  # DeepSpeedCPUAdam steps offloaded states


@pytest.mark.parametrize("yaml_text,needle", [
    ("zero:\n  stge: 3\n", "unknown config key 'zero.stge'; did you mean 'zero.stage'?"),
    ("stage: 3\n", "unknown config key 'stage'; did you mean 'zero.stage'?"),
    ("optimizer:\n  learning_rate: 0.1\n", "unknown config key 'optimizer.learning_rate'"),
    ("zero:\n  stage: 5\n", "config 'zero.stage'"),
    ("zero: [1, 2\n", "not valid YAML at line"),
    ("- a\n- b\n", "top level must be a mapping"),
    ("optimizer:\n  lr: -1\n", "optimizer.lr must be >= 0"),
    ("batch:\n  micro_batch: 0\n", "batch.micro_batch must be >= 1"),
    ("batch:\n  grad_accum: 0\n", "batch.grad_accum must be >= 1"),
    ("zero:\n  stage: 3\n  offload_param: nvme\n", "needs zero.nvme_path"),
    ("zero:\n  stage: 2\n  offload_optimizer: cpu\noptimizer:\n  name: sgd\n", "optimizer.name=sgd cannot be offloaded"),
    ("ds_overrides:\n  zero_optimization:\n    stage: 1\n", "conflicts with the typed setting zero.stage"),
    ("ds_overrides:\n  zero_optimization:\n    sub_group_size: auto\n", 'holds "auto"'),
])
def test_yaml_errors_are_one_line(tmp_path, yaml_text, needle):
    f = tmp_path / "run.yaml"
    f.write_text(yaml_text)
    with pytest.raises(ConfigError) as e:
        build_config(f)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_yaml(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        build_config(tmp_path / "nope.yaml")


def test_yaml_then_flags_and_roundtrip(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("zero:\n  stage: 1\noptimizer:\n  lr: 0.01\nds_overrides:\n  zero_optimization:\n    sub_group_size: 1000\n")
    cfg = build_config(f, {"zero.stage": 3, "batch.micro_batch": 2})
    assert (cfg.zero.stage, cfg.optimizer.lr, cfg.batch.micro_batch) == (3, 0.01, 2)
    assert build_ds_config(cfg)["zero_optimization"]["sub_group_size"] == 1000
    again = tmp_path / "again.yaml"
    again.write_text(to_yaml(cfg))
    assert build_config(again) == cfg


def test_global_batch_and_world_size():
    cfg = build_config(None, {"batch.micro_batch": 4, "batch.global_batch": 32})
    assert resolve_batch(cfg, 2) == (4, 4, 32)
    assert build_ds_config(cfg, world_size=2)["train_batch_size"] == 32
    with pytest.raises(ConfigError, match=r"global_batch=32 is not divisible by micro_batch 4 x world size 3 = 12"):
        resolve_batch(cfg, 3)
    plain = build_config(None, {"batch.micro_batch": 3, "batch.grad_accum": 2})
    assert resolve_batch(plain, 4) == (3, 2, 24)


def test_fp16_refused_on_cpu():
    cfg = build_config(None, {"precision.dtype": "fp16"})
    with pytest.raises(ConfigError, match="fp16 is not supported on CPU; use --precision bf16"):
        check_backend(cfg, "deepspeed", "cpu")
    assert check_backend(cfg, "deepspeed", "cuda") == []


def test_bf16_on_cpu_without_native_kernels_warns():
    cfg = build_config(None, {"precision.dtype": "bf16"})
    (line,) = check_backend(cfg, "deepspeed", "cpu", native_cpu_bf16=False)
    assert "precision.dtype=bf16" in line and "--precision fp32" in line
    assert check_backend(cfg, "deepspeed", "cpu", native_cpu_bf16=True) == []
    assert check_backend(cfg, "deepspeed", "cuda", native_cpu_bf16=False) == []
    assert check_backend(build_config(None, {}), "deepspeed", "cpu", native_cpu_bf16=False) == []  # fp32 default


def test_buckets_sized_from_model():
    tiny = bucket_sizes(ModelFacts(num_params=4_200_000, hidden_size=256))
    assert tiny.reduce_bucket_size == tiny.allgather_bucket_size == 4_259_840  # 65 x 2**16
    big = bucket_sizes(ModelFacts(num_params=7_000_000_000, hidden_size=4096))
    assert big.reduce_bucket_size == 500_000_000 and big.prefetch_bucket_size == 50_000_000
    cfg = build_config(None, {"zero.stage": 3, "zero.reduce_bucket_size": 1234})
    assert build_ds_config(cfg, model_facts=ModelFacts(4_200_000, 256))["zero_optimization"]["reduce_bucket_size"] == 1234


def test_reduce_scatter_follows_the_device():
    """One all-reduce per bucket on CPU ranks (gloo), DeepSpeed's per-rank slices on GPUs; a set value wins."""
    for stage in (1, 2):
        cfg = build_config(None, {"zero.stage": stage})
        assert build_ds_config(cfg)["zero_optimization"]["reduce_scatter"] is True
        assert build_ds_config(cfg, device="cpu")["zero_optimization"]["reduce_scatter"] is False
        forced = build_config(None, {"zero.stage": stage, "zero.reduce_scatter": True})
        assert build_ds_config(forced, device="cpu")["zero_optimization"]["reduce_scatter"] is True
    assert "reduce_scatter" not in build_ds_config(build_config(None, {"zero.stage": 3}), device="cpu")["zero_optimization"]


def test_hf_auto_flavour():
    cfg = build_config(None, {"zero.stage": 3, "precision.dtype": "bf16"})
    ds = build_ds_config(cfg, hf_auto=True)
    assert ds["train_micro_batch_size_per_gpu"] == ds["gradient_accumulation_steps"] == "auto"
    assert ds["optimizer"]["params"]["lr"] == "auto" and ds["bf16"]["enabled"] == "auto"
    assert isinstance(ds["zero_optimization"]["reduce_bucket_size"], int)  # ours, not HF's hidden-size rule


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "zerotrain", *args], capture_output=True, text=True,
                          env=rank_env(), cwd=REPO, timeout=120)


@pytest.mark.parametrize("args,needle", [
    (["--stage", "2", "--offload-param", "cpu"], "zero.offload_param=cpu needs ZeRO stage 3"),
    (["--stage", "3", "--offload-optimizer", "nvme"], "needs zero.nvme_path"),
    (["--micro-batch", "0"], "batch.micro_batch must be >= 1"),
    (["--grad-accum", "0"], "batch.grad_accum must be >= 1"),
    (["--stage", "4"], "config 'zero.stage'"),
    (["--lr", "-0.1"], "optimizer.lr must be >= 0"),
    (["--global-batch", "10", "--micro-batch", "4", "--world-size", "2"], "not divisible"),
    (["--config", "/nonexistent/run.yaml"], "file not found"),
])
def test_cli_errors(args, needle):
    r = _cli("config", *args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cli_writes_resolved_json(tmp_path):
    out = tmp_path / "z3.json"
    r = _cli("--local_rank=0", "config", "--stage", "3", "--offload-optimizer", "cpu", "--offload-param", "cpu",
             "--precision", "bf16", "--micro-batch", "4", "--grad-accum", "2", "-o", str(out))
    assert r.returncode == 0, r.stderr
    import json
    ds = json.loads(out.read_text())
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["gradient_accumulation_steps"] == 2 and ds["bf16"]["enabled"] is True
    assert "auto" not in out.read_text()


def test_cli_model_sizes_buckets(tmp_path):
    r = _cli("config", "--stage", "3", "--model", "tiny-gpt2")
    assert r.returncode == 0, r.stderr
    import json
    zo = json.loads(r.stdout)["zero_optimization"]
    assert zo["reduce_bucket_size"] == 196_608  # tiny-gpt2 (182,016 params) rounded up to 2**16: one bucket
    assert zo["leaf_module"] == {"classes": ["GPT2Block"]}  # read from the model's _no_split_modules


def test_stage3_leaf_blocks_rule():
    """Stage 3 names the model's transformer blocks as DeepSpeed leaf modules; never below stage 3, not
    when switched off, not without a known model; by default only for the model types they were measured
    faster on, forced on by zero.leaf_blocks: true; a raw override replaces the list."""
    from zerotrain.plan.run_plan import LEAF_BLOCKS_MEASURED, leaf_blocks

    size = ModelFacts(4_200_000, 256, block_classes=("GPT2Block",), model_type="gpt2")
    bert = ModelFacts(4_200_000, 256, block_classes=("BertLayer",), model_type="bert")

    def zo(overrides: dict, model_size=size) -> dict:
        return build_ds_config(build_config(None, overrides), model_facts=model_size)["zero_optimization"]

    assert {"gpt2", "llama"} <= LEAF_BLOCKS_MEASURED and "bert" not in LEAF_BLOCKS_MEASURED
    assert zo({"zero.stage": 3})["leaf_module"] == {"classes": ["GPT2Block"]}
    assert "leaf_module" not in zo({"zero.stage": 2})
    assert "leaf_module" not in zo({"zero.stage": 3, "zero.leaf_blocks": False})
    assert "leaf_module" not in zo({"zero.stage": 3}, ModelFacts(4_200_000, 256))
    assert "leaf_module" not in zo({"zero.stage": 3}, bert)  # unmeasured family: the speed default stays off
    assert zo({"zero.stage": 3, "zero.leaf_blocks": True}, bert)["leaf_module"] == {"classes": ["BertLayer"]}
    raw = {"zero.stage": 3, "ds_overrides": {"zero_optimization": {"leaf_module": {"classes": ["MyBlock"]}}}}
    assert zo(raw)["leaf_module"] == {"classes": ["MyBlock"]}
    # the banner's reason names the setting either way
    assert leaf_blocks(None, size)[1].startswith("on (GPT2Block): measured faster for gpt2")
    classes, why = leaf_blocks(None, bert)
    assert classes == () and "not measured for model type 'bert'" in why and "leaf_blocks: true" in why
    assert leaf_blocks(False, size) == ((), "off (zero.leaf_blocks: false)")


def test_block_classes_come_from_no_split_modules_or_the_layer_stack():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from zerotrain.model.facts import block_classes, model_facts

    assert model_facts("tiny-gpt2").block_classes == ("GPT2Block",)
    with torch.device("meta"):
        lm = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
        plain = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]))
    assert block_classes(lm) == ("GPT2Block",)
    assert block_classes(plain) == ("Linear",)  # no _no_split_modules: the first ModuleList's children


def test_every_field_documented():
    from pydantic import BaseModel

    from zerotrain.config.schema import field_paths

    def walk(cls):
        for name, info in cls.model_fields.items():
            assert info.description, f"{cls.__name__}.{name} has no docstring"
            if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
                walk(info.annotation)
    walk(RunConfig)
    assert "zero.stage" in field_paths()


def test_sgd_under_zero_is_allowed_explicitly():
    cfg = build_config(None, {"zero.stage": 2, "optimizer.name": "sgd"})
    ds = build_ds_config(cfg)
    assert ds["optimizer"]["type"] == "SGD" and ds["zero_allow_untested_optimizer"] is True
    assert "zero_allow_untested_optimizer" not in build_ds_config(build_config(None, {"zero.stage": 2}))
