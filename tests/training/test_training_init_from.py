"""Warm starts from a checkpoint (``checkpoint.init_from``, ``megaflex.training.weights``).

Sources are real ``megaflex.train`` runs (ZeRO 2 over two data-parallel ranks, ZeRO 0 with TP=2);
the reference weights are read from their DeepSpeed files directly (not through the module
under test), then the warm-started model's logits must equal the source model's bit for bit.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from megaflex.checkpoint.layout import model_states_file
from megaflex.model.config import ModelConfig
from megaflex.model.gpt import GPT
from megaflex.checkpoint.reshard import gpt_layout, merge_shards
from megaflex.training.config_loader import ConfigError
from megaflex.checkpoint import load_model_state, resolve_checkpoint
from megaflex.training.weights import (
    copy_parameters, init_from_checkpoint, kernel_parameter_names, linear_attention_parameter_names,
)
from training_harness import TINY, launch, write_config

pytestmark = pytest.mark.slow

SOURCES = {  # name -> (overrides, world size)
    "zero2_dp2": (["parallel.zero_stage=2"], 2),
    "zero0_tp2": (["parallel.zero_stage=0", "parallel.tensor_parallel_size=2"], 2),
}


def _tiny(**model: object) -> dict:
    cfg = copy.deepcopy(TINY)
    cfg["model"].update(model)
    cfg["train"]["train_iters"] = 3
    cfg["checkpoint"]["save_interval"] = 0
    return cfg


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("init_from_sources")
    cfg = write_config(root / "tiny.yaml", _tiny())
    out = {}
    for name, (overrides, world) in SOURCES.items():
        result = launch(cfg, overrides + [f"logging.run_dir={root / name}"], world)
        assert result.returncodes == [0] * world, result.output
        out[name] = root / name
    softmax = write_config(root / "softmax.yaml", _tiny(attention="softmax"))
    result = launch(softmax, [f"logging.run_dir={root / 'softmax'}"], 1)
    assert result.returncodes == [0], result.output
    out["softmax"] = root / "softmax"
    return out


def _reference_state(name: str, run: Path) -> dict[str, torch.Tensor]:
    """The source's full (TP=1) weights straight from its DeepSpeed files."""
    tag = resolve_checkpoint(run)
    if name == "zero2_dp2":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(str(tag.parent), tag=tag.name))
    tp = json.loads((tag / "megaflex.json").read_text())["tensor_parallel_size"]
    shards = [torch.load(model_states_file(tag, r), map_location="cpu", weights_only=False)["module"] for r in range(tp)]
    return merge_shards(shards, gpt_layout(_config())) if tp > 1 else shards[0]


def _config(**model: object) -> ModelConfig:
    return ModelConfig.from_dict(_tiny(**model)["model"])


def _fresh(seed: int = 99, **model: object) -> GPT:
    torch.manual_seed(seed)  # another init than the source's
    return GPT(_config(**model)).eval()


def _logits(model: GPT) -> torch.Tensor:
    ids = torch.arange(40).remainder(256).view(2, 20)
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("name", list(SOURCES))
def test_init_from_all_reproduces_the_source_logits(sources: dict[str, Path], name: str) -> None:
    reference = _fresh()
    reference.load_state_dict(_reference_state(name, sources[name]))
    model = _fresh()
    assert not torch.equal(_logits(model), _logits(reference))
    copied, path = init_from_checkpoint(model, sources[name], "all")
    assert path == resolve_checkpoint(sources[name])
    assert sorted(copied) == sorted(n for n, _ in model.named_parameters())
    assert torch.equal(_logits(model), _logits(reference))


def test_kernel_and_non_kernel_copy_only_their_parameters(sources: dict[str, Path]) -> None:
    state = load_model_state(sources["zero0_tp2"])
    fresh = {n: p.detach().clone() for n, p in _fresh().named_parameters()}
    kernel = kernel_parameter_names(_fresh())
    assert kernel and all(".feature_map." in n or n.endswith(".core.decay_logit") for n in kernel)  # the decay: default
    for selection, copied_set in (("kernel", kernel), ("non_kernel", set(fresh) - kernel)):
        model = _fresh()
        copied, _ = init_from_checkpoint(model, sources["zero0_tp2"], selection)
        assert set(copied) == copied_set
        for n, p in model.named_parameters():
            want = state[n] if n in copied_set else fresh[n]
            assert torch.equal(p, want), (selection, n)
            assert not torch.equal(state[n], fresh[n]), n  # the check can tell source from init


def test_softmax_source_into_flexformer_keeps_the_kernel_fresh(sources: dict[str, Path]) -> None:
    state = load_model_state(sources["softmax"])
    model = _fresh()
    fresh = {n: p.detach().clone() for n, p in model.named_parameters()}
    copied, _ = init_from_checkpoint(model, sources["softmax"], "all")
    optional = linear_attention_parameter_names(model)
    assert set(copied) == set(fresh) - optional and any(n.endswith("omega1") for n in optional)
    for n, p in model.named_parameters():
        assert torch.equal(p, fresh[n] if n in optional else state[n]), n
    with pytest.raises(ConfigError, match=r"no parameter 'blocks\.0\.attn\.core\.(decay_logit|feature_map\.omega1)'.*init_parameters=kernel"):
        init_from_checkpoint(_fresh(), sources["softmax"], "kernel")


def test_bad_sources_are_named(sources: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"checkpoint.init_from: .*{tmp_path / 'nowhere'}"):
        init_from_checkpoint(_fresh(), tmp_path / "nowhere")
    wider = _fresh(ffn_hidden_size=256)
    with pytest.raises(ConfigError, match=r"parameter 'blocks\.0\.mlp\.fc_in\.weight': expected shape \[256, 64\].*got \[128, 64\]"):
        init_from_checkpoint(wider, sources["zero0_tp2"])
    with_bias = _fresh(bias=True)
    with pytest.raises(ConfigError, match=r"no parameter 'blocks\.0\.attn\.qkv\.bias'.*only kernel parameters"):
        init_from_checkpoint(with_bias, sources["zero0_tp2"])
    state = load_model_state(sources["zero0_tp2"])
    with pytest.raises(ValueError, match="selection: expected one of"):
        copy_parameters(_fresh(), state, "kernels")


def test_trainer_warm_start_with_frozen_kernel(sources: dict[str, Path], tmp_path: Path) -> None:
    """The kernel-transfer recipe: copy the kernel, freeze it with LR multiplier 0, train the rest."""
    cfg = write_config(tmp_path / "tiny.yaml", _tiny())
    run = tmp_path / "run"
    result = launch(cfg, [
        f"logging.run_dir={run}", f"checkpoint.init_from={sources['zero2_dp2']}", "checkpoint.init_parameters=kernel",
        "optimizer.kernel_frequency_lr_multiplier=0", "optimizer.kernel_temperature_lr_multiplier=0",
    ])
    assert result.returncodes == [0], result.output
    assert "initialised 8 parameter tensors (kernel)" in result.outputs[0]  # 2 layers: omega1, omega2, tau, decay
    source, trained = load_model_state(sources["zero2_dp2"]), load_model_state(run)
    kernel = kernel_parameter_names(_fresh())
    for n, value in trained.items():
        assert torch.equal(value, source[n]) == (n in kernel), n
    meta = json.loads((resolve_checkpoint(run) / "megaflex.json").read_text())
    assert meta["init_from"] == {"path": str(resolve_checkpoint(sources["zero2_dp2"])), "parameters": "kernel", "copied": 8}

    missing = launch(cfg, [f"logging.run_dir={tmp_path / 'bad'}", f"checkpoint.init_from={tmp_path / 'nowhere'}"])
    assert missing.returncodes == [2], missing.output
    assert "config error: checkpoint.init_from:" in missing.outputs[0] and "nowhere" in missing.outputs[0]
