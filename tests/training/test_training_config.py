"""Config system, generated DeepSpeed config, LR schedule, weight-decay groups, checkpoint discovery."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from megaflex.model.config import ModelConfig
from megaflex.model.gpt import GPT
from megaflex.checkpoint import CheckpointError, CheckpointMeta, check_compatible, parameter_shapes, select_checkpoint
from megaflex.training.config import (
    FLOAT_RANGES, Config, ConfigError, TrainConfig, load_config, parallel_dims, reference_markdown,
    validate_runtime,
)
from megaflex.training.config_loader import float_fields
from megaflex.training.deepspeed_config import deepspeed_config
from megaflex.training.metrics import peak_tflops_of
from megaflex.training.optim import lr_at, param_groups
from training_harness import REPO, TINY

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def write(tmp_path: Path, name: str, data: dict) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write(tmp_path, "tiny.yaml", TINY)


def test_files_merge_in_order_then_overrides(tmp_path: Path, tiny: Path) -> None:
    second = write(tmp_path, "b.yaml", {"train": {"lr": 1e-4, "precision": "bf16"}, "parallel": {"zero_stage": 3}})
    cfg = load_config([tiny, second], ["train.lr=3e-4", "data.seq_len=32"])
    assert cfg.train.lr == 3e-4 and cfg.train.precision == "bf16" and cfg.parallel.zero_stage == 3
    assert cfg.train.train_iters == TINY["train"]["train_iters"]  # untouched keys of the first file survive
    assert cfg.where("train.lr") == "command line" and cfg.where("train.precision") == str(second)
    assert cfg.where("train.train_iters") == str(tiny) and cfg.where("train.grad_clip") == "defaults"
    assert cfg.model.hidden_size == 64 and cfg.data.seq_len == 32


@pytest.mark.parametrize(
    "override,needle",
    [
        ("train.lrr=1", "unknown config key 'train.lrr' (from command line); allowed keys in train:"),
        ("bogus.x=1", "unknown config key 'bogus'"),
        ("train.lr=fast", "config key 'train.lr' (from command line): expected float, got 'fast'"),
        ("train.train_iters=1.5", "config key 'train.train_iters' (from command line): expected int, got 1.5"),
        ("train.precision=fp8", "expected one of 'auto', 'fp32', 'bf16', 'fp16', got 'fp8'"),
        ("logging.tensorboard=3", "expected bool, got 3"),
        ("parallel.zero_stage=4", "parallel.zero_stage (from command line): expected one of 0, 1, 2, 3, got 4"),
        ("train.global_batch_size=9", "train.global_batch_size (from command line): expected a multiple of train.micro_batch_size (2), got 9"),
        ("data.seq_len=65", "data.seq_len (from command line): expected <= model.max_seq_len (64), got 65"),
        ("parallel.zero_offload_optimizer=true", "needs parallel.zero_stage >= 1"),
        ("parallel.deferred_init=true", "parallel.deferred_init (from command line): true needs parallel.zero_stage 3, got stage 1"),
        ("parallel.deferred_init=sometimes", "config key 'parallel.deferred_init' (from command line): expected"),
        ("parallel.tensor_parallel_size=3", "num_heads: expected a multiple of the tensor-parallel size 3, got 4"),
        ("schedule.warmup_iters=50", "schedule.warmup_iters (from"),
        ("schedule.min_lr=1.0", "expected <= train.lr"),
        ("train.micro_batch_size=0", "train.micro_batch_size (from command line): expected a positive integer, got 0"),
        ("data.source=indexed", "data.train_path (from defaults): data.source is 'indexed' but no training data"),
        ("model.hidden_size=66", "model.hidden_size (from command line): hidden_size (66) must be divisible"),
        ("model.feature_dim=33", "model.feature_dim (from command line): feature_dim of attention='flexformer_n'"),
    ],
)
def test_rejected_configs_name_key_source_and_allowed(tiny: Path, override: str, needle: str) -> None:
    overrides = [override] + (["parallel.zero_stage=0"] if "offload" in override else [])
    with pytest.raises(ConfigError) as e:
        load_config([tiny], overrides)
    assert needle in str(e.value)


def test_errors_name_the_file(tmp_path: Path, tiny: Path) -> None:
    bad = write(tmp_path, "bad.yaml", {"optimizer": {"beta3": 0.9}})
    with pytest.raises(ConfigError, match=rf"optimizer.beta3' \(from {bad}\).*allowed keys in optimizer: beta1, beta2"):
        load_config([tiny, bad])
    with pytest.raises(ConfigError, match="no 'model' section"):
        load_config([bad])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config([tmp_path / "missing.yaml"])


FLOAT_KEYS = float_fields(Config)


def _override(key: str, value: str) -> str:
    return f"{key}=[{value}]" if key == "data.train_weights" else f"{key}={value}"


def test_every_float_field_has_a_range() -> None:
    assert len(FLOAT_KEYS) >= 20 and "train.lr" in FLOAT_KEYS and "model.norm_eps" in FLOAT_KEYS
    missing = sorted(set(FLOAT_KEYS) - set(FLOAT_RANGES))
    assert not missing, f"float config fields without a range in megaflex.training.config.FLOAT_RANGES: {missing}"
    assert not set(FLOAT_RANGES) - set(FLOAT_KEYS), "FLOAT_RANGES names keys that are not float fields"


@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_every_float_field_refuses_non_finite_and_out_of_range(tiny: Path, tmp_path: Path, key: str) -> None:
    rule = FLOAT_RANGES[key]
    outside = [".nan", ".inf", "-.inf"]
    if rule.low is not None:
        outside.append(str(rule.low if rule.low_open else rule.low - 1))
    if rule.high is not None:
        outside.append(str(rule.high if rule.high_open else rule.high + 1))
    for value in outside:
        with pytest.raises(ConfigError) as e:
            load_config([tiny], [_override(key, value)])
        assert f"config key '{key}" in str(e.value) and "(from command line): expected a finite float" in str(e.value)
        assert rule.describe() in str(e.value)
    section, name = key.split(".")
    in_file = write(tmp_path, "bad.yaml", {section: {name: [float("nan")] if key == "data.train_weights" else float("inf")}})
    with pytest.raises(ConfigError, match=rf"'{key}.*\(from {in_file}\)"):
        load_config([tiny, in_file])


def test_float_defaults_are_in_range(tiny: Path) -> None:
    cfg = load_config([tiny])
    for key in FLOAT_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        for v in value if isinstance(value, list) else [value] if value is not None else []:
            assert math.isfinite(v) and FLOAT_RANGES[key].contains(v), (key, v)


def test_all_zero_blend_weights_are_refused(tiny: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.train_weights \(from command line\): expected at least one weight > 0"):
        load_config([tiny], ["data.source=indexed", "data.train_path=[a,b]", "data.train_weights=[0,0]"])


def test_self_referential_yaml_alias_is_a_config_error(tmp_path: Path, tiny: Path) -> None:
    loop = tmp_path / "loop.yaml"
    loop.write_text("train: &t\n  lr: 0.1\n  again: *t\n")
    with pytest.raises(ConfigError, match=rf"{loop}: self-referential YAML alias at key 'train.again'"):
        load_config([tiny, loop])


def test_runtime_combinations(tiny: Path) -> None:
    cfg = load_config([tiny], ["parallel.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"parallel.tensor_parallel_size .*expected a divisor of the world size 3, got 2 x 1 x 1 = 2"):
        validate_runtime(cfg, world_size=3, has_cuda=False)
    cfg = load_config([tiny], ["train.global_batch_size=6"])  # 6 = 3 x micro 2, but DP 2 needs a multiple of 4
    with pytest.raises(ConfigError, match=r"micro_batch_size x data-parallel size \(2 x 2\), got 6"):
        validate_runtime(cfg, world_size=2, has_cuda=False)
    cfg = load_config([tiny], ["train.precision=fp16"])
    with pytest.raises(ConfigError, match="fp16 needs a GPU"):
        validate_runtime(cfg, world_size=1, has_cuda=False)
    validate_runtime(cfg, world_size=1, has_cuda=True)  # fine on a GPU


def test_attention_backend_that_cannot_run_on_the_device_is_a_config_error(tiny: Path, monkeypatch) -> None:
    """Issue 37: triton on CPU without the interpreter (and fla on CPU) failed in the first forward, a traceback."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = load_config([tiny], ["model.attention_backend=triton"])
    with pytest.raises(ConfigError, match=r"^model.attention_backend \(from command line\): triton on CPU runs only "
                                          r"under Triton's interpreter: export TRITON_INTERPRET=1 .* or use "
                                          r"model.attention_backend=auto"):
        validate_runtime(cfg, world_size=1, has_cuda=False)
    validate_runtime(cfg, world_size=1, has_cuda=True)  # the GPU path
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    validate_runtime(load_config([tiny], ["model.attention_backend=triton"]), world_size=1, has_cuda=False)  # tests
    cfg = load_config([tiny], ["model.attention_backend=fla"])
    with pytest.raises(ConfigError, match=r"model.attention_backend \(from command line\): fla runs on CUDA only"):
        validate_runtime(cfg, world_size=1, has_cuda=False)
    cfg = load_config([tiny], ["model.attention_backend=fla", "train.device=cpu"])  # a GPU machine told to use CPU
    with pytest.raises(ConfigError, match="fla runs on CUDA only"):
        validate_runtime(cfg, world_size=1, has_cuda=True)


def test_precision_auto_is_bf16_on_cuda_and_fp32_on_cpu(tiny: Path) -> None:
    assert TrainConfig().precision == "auto"  # the default when no config sets it
    for has_cuda, device, expected in ((True, "auto", "bf16"), (False, "auto", "fp32"), (True, "cpu", "fp32")):
        cfg = load_config([tiny], ["train.precision=auto", f"train.device={device}"])
        validate_runtime(cfg, world_size=1, has_cuda=has_cuda)
        assert cfg.train.precision == expected, (has_cuda, device)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_load_with_every_zero_preset(path: Path) -> None:
    for preset in sorted((REPO / "configs" / "zero").glob("*.yaml")):
        cfg = load_config([path, preset])
        assert cfg.parallel.zero_stage == yaml.safe_load(preset.read_text())["parallel"]["zero_stage"]
        assert cfg.data.seq_len <= cfg.model.max_seq_len


def test_deepspeed_config_is_generated(tiny: Path) -> None:
    cfg = load_config([tiny], ["parallel.zero_stage=3", "train.precision=bf16", "train.grad_clip=0.5", "train.global_batch_size=16"])
    ds = deepspeed_config(cfg, dp_size=2)
    assert ds["train_batch_size"] == 16 and ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 4 and ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert "optimizer" not in ds and "scheduler" not in ds  # torch AdamW + our schedule
    cfg = load_config([tiny], ["parallel.zero_stage=0", "train.precision=fp16"])
    ds = deepspeed_config(cfg, dp_size=1)
    assert ds["fp16"]["enabled"] and ds["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    assert ds["gradient_accumulation_steps"] == 4 and ds["zero_optimization"] == {"stage": 0}
    json.dumps(ds)  # serialisable as the JSON DeepSpeed reads


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_bf16_reduces_and_accumulates_gradients_in_fp32(tiny: Path, zero_stage: int) -> None:
    from deepspeed.runtime.config import get_communication_data_type
    from deepspeed.runtime.constants import DATA_TYPES, GRAD_ACCUM_DTYPE

    cfg = load_config([tiny], [f"parallel.zero_stage={zero_stage}", "train.precision=bf16"])
    ds = deepspeed_config(cfg, dp_size=2)
    assert get_communication_data_type(ds) == torch.float32  # read with DeepSpeed's own key names
    # DeepSpeed 0.19 rejects fp32 accumulation of bf16 gradients at ZeRO 0 ("unsupported mix")
    assert ds.get(DATA_TYPES, {}).get(GRAD_ACCUM_DTYPE) == (None if zero_stage == 0 else "fp32")
    fp32 = deepspeed_config(load_config([tiny], [f"parallel.zero_stage={zero_stage}"]), dp_size=2)
    assert "communication_data_type" not in fp32 and DATA_TYPES not in fp32
    plain = deepspeed_config(load_config([tiny], [f"parallel.zero_stage={zero_stage}", "train.precision=bf16",
                                                  "train.grad_accum_dtype=bf16"]), dp_size=2)  # fmt: skip
    assert get_communication_data_type(plain) == torch.bfloat16  # the ablation arm: DeepSpeed's plain bf16


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA GH200 480GB", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("Tesla T4", None),
])
def test_mfu_peak_per_gpu_variant(name: str, peak: float | None) -> None:
    assert peak_tflops_of(name) == peak


@pytest.mark.parametrize("on_cuda", [False, True])
def test_offloaded_optimizer_pins_host_memory_on_cuda(tiny: Path, on_cuda: bool) -> None:
    cfg = load_config([tiny], ["parallel.zero_stage=2", "parallel.zero_offload_optimizer=true"])
    offload = deepspeed_config(cfg, dp_size=1, on_cuda=on_cuda)["zero_optimization"]["offload_optimizer"]
    assert offload == {"device": "cpu", "pin_memory": on_cuda}


def test_lr_schedule_warmup_cosine_linear(tiny: Path) -> None:
    cfg = load_config([tiny], ["train.lr=1.0", "schedule.warmup_iters=4", "schedule.min_lr=0.1", "train.train_iters=14"])
    assert [lr_at(cfg, i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(cfg, 9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # halfway
    assert lr_at(cfg, 14) == pytest.approx(0.1) and lr_at(cfg, 100) == pytest.approx(0.1)
    cfg = load_config([tiny], ["train.lr=1.0", "schedule.warmup_iters=0", "schedule.min_lr=0.0",
                               "schedule.decay_style=linear", "schedule.decay_iters=10"])
    assert [round(lr_at(cfg, i), 10) for i in (0, 5, 10)] == [1.0, 0.5, 0.0]


def test_weight_decay_groups_exempt_norms_biases_and_the_kernel() -> None:
    model = GPT(ModelConfig(**{**TINY["model"], "bias": True}))
    groups = {g["name"]: g for g in param_groups(model, 0.1, ["omega", "tau"])}
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = {names[id(p)] for p in groups["no_decay"]["params"]}
    decay = {names[id(p)] for p in groups["decay"]["params"]}
    assert groups["no_decay"]["weight_decay"] == 0.0 and groups["decay"]["weight_decay"] == 0.1
    assert any(n.endswith("omega1") for n in no_decay) and any(n.endswith(".tau") for n in no_decay)
    assert any(n.endswith("norm.weight") for n in no_decay) and any(n.endswith(".bias") for n in no_decay)
    assert "embed.weight" in decay and all(model.get_parameter(n).dim() == 2 for n in decay)
    assert decay | no_decay == set(names.values()) and not decay & no_decay


def test_resume_discovery_ignores_incomplete_saves(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    assert select_checkpoint(ckpt, "auto")[0] is None
    for tag in ("step_00000005", "step_00000010", ".tmp-step_00000015", "step_00000020"):
        (ckpt / tag).mkdir(parents=True)
    for tag in ("step_00000005", "step_00000010"):
        (ckpt / tag / "megaflex.json").write_text("{}")
    # step 20 has no metadata (a crash before commit of an old-style writer); pointer is stale.
    (ckpt / "latest").write_text("step_00000020\n")
    assert select_checkpoint(ckpt, "auto")[0] == ckpt / "step_00000010"
    (ckpt / "latest").write_text("step_00000005\n")
    assert select_checkpoint(ckpt, "auto")[0] == ckpt / "step_00000005"
    assert select_checkpoint(ckpt, "none")[0] is None
    assert select_checkpoint(ckpt, "step_00000010")[0] == ckpt / "step_00000010"
    with pytest.raises(CheckpointError, match=r"'step_00000020' is not a complete checkpoint"):
        select_checkpoint(ckpt, "step_00000020")[0]


def test_shape_mismatch_names_both_shapes() -> None:
    small, big = ModelConfig(**TINY["model"]), ModelConfig(**{**TINY["model"], "num_layers": 3})
    meta = CheckpointMeta(tensor_parallel_size=1, parameter_shapes=parameter_shapes(GPT(small)),
                          config={"model": small.to_dict()})
    check_compatible(meta, small.to_dict(), parameter_shapes(GPT(small)), tp_size=1)  # same: fine
    with pytest.raises(CheckpointError, match=r"trained with model.num_layers=2, this run has model.num_layers=3; "
                                              r"its parameters do not fit \(blocks.2.\S+: checkpoint absent vs config \["):
        check_compatible(meta, big.to_dict(), parameter_shapes(GPT(big)), tp_size=1)
    other_code = CheckpointMeta(tensor_parallel_size=1, parameter_shapes=parameter_shapes(GPT(big)),
                                config={"model": small.to_dict()})  # same fields, other shapes (another version)
    with pytest.raises(CheckpointError, match=r"blocks.2.\S+: checkpoint \[.*\] vs config absent; model fields .*: \{\}"):
        check_compatible(other_code, small.to_dict(), parameter_shapes(GPT(small)), tp_size=1)
    with pytest.raises(CheckpointError, match="tensor_parallel_size=1, this run 2"):
        check_compatible(meta, small.to_dict(), parameter_shapes(GPT(small)), tp_size=2)


def _saved(model: ModelConfig, drop: tuple[str, ...] = ()) -> CheckpointMeta:
    """The metadata of a checkpoint of ``model``; ``drop``: fields it does not record (older versions)."""
    recorded = {k: v for k, v in model.to_dict().items() if k not in drop}
    return CheckpointMeta(tensor_parallel_size=1, parameter_shapes=parameter_shapes(GPT(model)), config={"model": recorded})


def _resume(meta: CheckpointMeta, model: ModelConfig) -> None:
    check_compatible(meta, model.to_dict(), parameter_shapes(GPT(model)), tp_size=1, path="R/step_00000002")


@pytest.mark.parametrize("field,value,same_shapes", [
    ("normalization", "denominator", True), ("position", "none", True), ("rope_theta", 500.0, True),
    ("norm_eps", 1e-6, True), ("vocab_size", 250, True), ("mlp", "swiglu", False), ("norm", "layernorm", False),
    ("attention", "flexformer_s", False), ("softmax_window", 8, False), ("normalization", "rms", False),
    ("causal", False, True), ("kernel_decay", "learned", False),
])
def test_resume_refuses_a_changed_model_field(field: str, value: object, same_shapes: bool) -> None:
    """Other maths: refused naming both values and the way out, also where every shape is the same
    (those resumed silently as another model before)."""
    base = {**TINY["model"], "kernel_decay": "none"}  # one field changes: causal=False keeps no decay either
    saved = ModelConfig(**base)
    changed = ModelConfig(**{**base, field: value})
    assert (parameter_shapes(GPT(changed)) == parameter_shapes(GPT(saved))) == same_shapes
    with pytest.raises(CheckpointError) as err:
        _resume(_saved(saved), changed)
    message = str(err.value)
    assert f"was trained with model.{field}={getattr(saved, field)}, this run has model.{field}={value};" in message
    assert f"Set model.{field}={getattr(saved, field)} to continue this run, or" in message
    assert ("(same shapes, other maths)" in message) == same_shapes
    assert ("its parameters do not fit" in message) != same_shapes
    assert "checkpoint.init_from=R/step_00000002 checkpoint.resume=none" in message


def test_resume_allows_fields_that_do_not_change_what_the_weights_compute() -> None:
    saved = ModelConfig(**TINY["model"])
    _resume(_saved(saved), ModelConfig(**{**TINY["model"], "attention_backend": "torch", "chunk_size": 16,
                                          "activation_checkpointing": True, "hidden_dropout": 0.1,
                                          "attention_dropout": 0.1, "init_std": 0.05, "max_seq_len": 128}))
    # fields the model does not read: the window mixing without a window, a softmax model's normalisation
    _resume(_saved(saved), ModelConfig(**{**TINY["model"], "window_mixing": "gated"}))
    softmax = {**TINY["model"], "attention": "softmax"}
    _resume(_saved(ModelConfig(**softmax, normalization="rms")), ModelConfig(**softmax))
    with pytest.raises(CheckpointError, match="model.max_seq_len=64, this run has model.max_seq_len=128"):
        cosformer = {**TINY["model"], "attention": "cosformer"}  # its angles depend on max_seq_len
        _resume(_saved(ModelConfig(**cosformer)), ModelConfig(**{**cosformer, "max_seq_len": 128}))


def test_resume_of_a_checkpoint_without_normalization_says_how_to_continue() -> None:
    """Checkpoints from before model.normalization were trained with rms; today's default is capped_denominator."""
    old = _saved(ModelConfig(**TINY["model"], normalization="rms"), drop=("normalization",))
    with pytest.raises(CheckpointError) as err:
        _resume(old, ModelConfig(**TINY["model"]))
    assert str(err.value).startswith(
        "checkpoint R/step_00000002 was trained with model.normalization=rms (it records no model.normalization: "
        "written when rms was the default; the default is now capped_denominator), this run has "
        "model.normalization=capped_denominator;")
    assert "Set model.normalization=rms to continue this run, or start a new run from its weights: " \
           "checkpoint.init_from=R/step_00000002 checkpoint.resume=none" in str(err.value)
    _resume(old, ModelConfig(**TINY["model"], normalization="rms"))  # as the message says
    # an old softmax checkpoint (no normalisation acts) resumes under the new default
    softmax = {**TINY["model"], "attention": "softmax"}
    _resume(_saved(ModelConfig(**softmax), drop=("normalization",)), ModelConfig(**softmax))


def test_a_checkpoint_without_kernel_decay_had_none() -> None:
    """Checkpoints from before model.kernel_decay had no decay; today's default (auto) is learned for causal linear
    attention: they refuse it naming why and how to continue, and resume with kernel_decay none."""
    old = _saved(ModelConfig(**TINY["model"], kernel_decay="none"), drop=("kernel_decay",))
    assert ModelConfig(**TINY["model"]).kernel_decay == "learned"
    with pytest.raises(CheckpointError) as err:
        _resume(old, ModelConfig(**TINY["model"]))
    assert str(err.value).startswith(
        "checkpoint R/step_00000002 was trained with model.kernel_decay=none (it records no model.kernel_decay: written "
        "before the decay existed, so none; the default is now learned for causal linear attention), this run has "
        "model.kernel_decay=learned; its parameters do not fit")
    assert "Set model.kernel_decay=none to continue this run" in str(err.value)
    _resume(old, ModelConfig(**TINY["model"], kernel_decay="none"))  # as the message says
    # an old softmax checkpoint (no decay then or now) resumes under the new default
    softmax = {**TINY["model"], "attention": "softmax"}
    _resume(_saved(ModelConfig(**softmax), drop=("kernel_decay",)), ModelConfig(**softmax))


def test_a_checkpoint_without_causal_was_causal() -> None:
    """Checkpoints from before model.causal were causal: they resume causal, and refuse causal=False."""
    plain = {**TINY["model"], "kernel_decay": "none"}  # what a bidirectional model can have too
    old = _saved(ModelConfig(**plain), drop=("causal",))
    _resume(old, ModelConfig(**plain))
    with pytest.raises(CheckpointError, match="trained with model.causal=True, this run has model.causal=False"):
        _resume(old, ModelConfig(**plain, causal=False))


@pytest.mark.usefixtures("forked_python")
def test_cli_reports_config_errors(tiny: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "megaflex.train", "--config", str(tiny), "train.nope=1"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2
    assert "config error: unknown config key 'train.nope' (from command line)" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA is unusable")
@pytest.mark.usefixtures("forked_python")
def test_train_device_cuda_without_cuda_is_one_error_line(tiny: Path, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "megaflex.train", "--config", str(tiny), "train.device=cuda",
         f"logging.run_dir={tmp_path / 'run'}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "config error: train.device (from command line): cuda requested but CUDA is unusable: " in errors[0]
    from megaflex.parallel.launcher_env import cuda_unusable_reason

    assert cuda_unusable_reason() in errors[0] and "train.device=cpu" in errors[0]
    assert not (tmp_path / "run").exists()  # stopped before any rank set anything up


def test_reference_documents_every_field() -> None:
    ref = reference_markdown()
    for key in ("train.lr", "parallel.zero_stage", "checkpoint.resume", "model.feature_dim", "fault.sigkill_after_step"):
        assert f"`{key}`" in ref
    doc = (REPO / "docs" / "training.md").read_text()
    assert ref in doc, "docs/training.md is stale: regenerate with python -m megaflex.training.config --reference"


PP2 = ["parallel.pipeline_parallel_size=2"]


@pytest.mark.parametrize(
    "overrides,key,needle",
    [
        (["parallel.zero_stage=2"], "parallel.zero_stage", "DeepSpeed's pipeline engine refuses ZeRO-2 and ZeRO-3), got 2"),
        (["parallel.zero_stage=3"], "parallel.zero_stage", "got 3"),
        (["parallel.zero_stage=0"], "parallel.zero_stage", "ZeRO-0 clipping norm is wrong under pipeline parallelism"),
        (["parallel.context_parallel_size=2"], "parallel.pipeline_parallel_size",
         "context parallelism and pipeline parallelism are not supported together"),
        (["model.num_layers=1"], "parallel.pipeline_parallel_size", "expected at most model.num_layers (1) stages"),
        (["data.document_boundaries=reset", "data.eod_token_id=0"], "data.document_boundaries", "expected 'none'"),
        (["fault.nan_loss_at_steps=[3]"], "fault.nan_loss_at_steps", "expected [] with"),
        (["parallel.pipeline_parallel_size=0"], "parallel.pipeline_parallel_size", "expected a positive integer, got 0"),
    ],
)
def test_pipeline_parallel_refusals_name_the_key(tiny: Path, overrides: list[str], key: str, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config([tiny], PP2 + overrides)
    assert str(e.value).startswith(f"{key} (from ") and needle in str(e.value)


def test_pipeline_parallel_grid_on_the_world(tiny: Path) -> None:
    cfg = load_config([tiny], PP2 + ["parallel.zero_stage=1", "parallel.tensor_parallel_size=2"])
    dims = parallel_dims(cfg, 8)
    assert (dims.pp_size, dims.tp_size, dims.dp_size) == (2, 2, 2)
    assert dims.coords(5) == (1, 0, 0, 1)  # pipeline stages are the outermost blocks of ranks
    with pytest.raises(ConfigError, match=r"divisor of the world size 6, got 2 x 1 x 2 = 4"):
        validate_runtime(cfg, world_size=6, has_cuda=False)
