"""ModelConfig validation, the named size configs and the ``megaflex.model.summary`` CLI."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
import yaml

from megaflex.model import GPT, ModelConfig
from megaflex.model.summary import build_meta_model, load_model_config, summarize

from conftest import REPO_ROOT

CONFIGS = REPO_ROOT / "configs"
BASE = dict(vocab_size=100, num_layers=2, hidden_size=32, num_heads=4)


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"hidden_size": 30}, "hidden_size"),
        ({"num_heads": 0}, "num_heads"),
        ({"ffn_hidden_size": 0}, "ffn_hidden_size"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"num_layers": 2.0}, "num_layers"),
        ({"attention": "favor"}, "attention"),
        ({"normalization": "softmax"}, "normalization"),
        ({"mlp": "relu"}, "mlp"),
        ({"norm": "batchnorm"}, "norm"),
        ({"position": "alibi"}, "position"),
        ({"hidden_size": 36, "num_heads": 4}, "head dim"),  # rope needs an even head dim (9)
        ({"hidden_dropout": 1.0}, "hidden_dropout"),
        ({"attention_dropout": -0.1}, "attention_dropout"),
        ({"init_std": 0.0}, "init_std"),
        ({"feature_kwargs": [1]}, "feature_kwargs"),
        ({"attention": "softmax", "feature_kwargs": {"variant": "trig"}}, "feature_kwargs"),
        ({"kernel_decay": "fixed"}, "kernel_decay"),
        ({"attention": "softmax", "softmax_window": 8, "kernel_decay": "learned"}, "kernel_decay"),
    ],
)
def test_invalid_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**{**BASE, **overrides})


def test_unknown_attention_kind_lists_the_known_ones():
    with pytest.raises(ValueError, match="flexformer_n") as err:
        ModelConfig(**BASE, attention="linformer")
    assert "softmax" in str(err.value) and "'linformer'" in str(err.value)


def test_from_dict_rejects_unknown_and_missing_keys():
    with pytest.raises(ValueError, match=r"\['dropuot', 'n_layer'\]"):
        ModelConfig.from_dict({**BASE, "dropuot": 0.1, "n_layer": 3})
    with pytest.raises(ValueError, match=r"missing.*\['num_heads'\]"):
        ModelConfig.from_dict({k: v for k, v in BASE.items() if k != "num_heads"})
    config = ModelConfig.from_dict({**BASE, "mlp": "swiglu"})
    assert ModelConfig.from_dict(config.to_dict()) == config


def test_default_ffn_width():
    assert ModelConfig(**BASE).ffn_hidden_size == 4 * 32
    # SwiGLU: 8/3 h rounded up to a multiple of 64 keeps the MLP size of a 4h GELU MLP (roughly).
    assert ModelConfig(**{**BASE, "hidden_size": 768, "num_heads": 12}, mlp="swiglu").ffn_hidden_size == 2048


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"attention": "flexformer_n", "feature_dim": 15}, "feature_dim"),  # trig maps: F = 2D
        ({"attention": "performer", "feature_kwargs": {"variant": "cosine"}}, "variant"),
        ({"attention": "flexformer_s", "feature_kwargs": {"redraw_interval": 10}}, "redraw_interval"),
    ],
)
def test_feature_map_misfit_is_reported_when_the_config_is_made(overrides, field):
    with pytest.raises(ValueError, match=field):  # at ModelConfig construction, before any model is built
        GPT(ModelConfig(**BASE, **overrides))


def test_kernel_decay_auto_is_learned_for_causal_linear_attention_only():
    """Issue 46: the default (auto) is the study-v5 recipe's decay where a decay exists (causal linear attention,
    the window hybrid's far field included) and none elsewhere; a built config records the resolved value, which
    is what checkpoints and config.json keep."""
    assert ModelConfig(**BASE).kernel_decay == "learned"
    assert ModelConfig(**BASE, softmax_window=8).kernel_decay == "learned"
    assert ModelConfig(**BASE, attention="performer").kernel_decay == "learned"
    assert ModelConfig(**BASE, attention="softmax").kernel_decay == "none"
    assert ModelConfig(**BASE, causal=False).kernel_decay == "none"
    assert ModelConfig(**BASE).to_dict()["kernel_decay"] == "learned"
    model = GPT(ModelConfig(**BASE))
    assert all(block.attn.core.decay_logit.shape == (4,) for block in model.blocks)
    with pytest.raises(ValueError, match="kernel_decay must be 'none' for attention='softmax'"):
        ModelConfig(**BASE, attention="softmax", kernel_decay="learned")
    with pytest.raises(ValueError, match=r"kernel_decay must be one of \['auto', 'none', 'learned'\], got 'fixed'"):
        ModelConfig(**BASE, kernel_decay="fixed")


@pytest.mark.parametrize("path", sorted(p.name for p in CONFIGS.glob("flexformer_n_*.yaml")))
def test_every_flexformer_n_config_ships_the_study_v5_recipe(path):
    config = load_model_config(CONFIGS / path)
    assert (config.attention, config.normalization, config.kernel_decay) == ("flexformer_n", "capped_denominator", "learned")


def test_head_dim_rope_odd_allowed_without_rope():
    assert ModelConfig(**{**BASE, "hidden_size": 36}, position="none").head_dim == 9


# ---------------------------------------------------------------- named configs and summary


def printed_count(text: str) -> int:
    last = text.strip().splitlines()[-1]
    assert last.startswith("parameters: ")
    return int(last.split()[1])


@pytest.mark.parametrize("name", ["tiny", "flexformer_n_41m", "softmax_41m"])
def test_summary_count_equals_the_built_model(name):
    config = load_model_config(CONFIGS / f"{name}.yaml")
    torch.manual_seed(0)
    model = GPT(config)  # a real CPU build, not the summary's meta build
    assert printed_count(summarize(config)) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("path", sorted(p.name for p in CONFIGS.glob("*.yaml") if "Exact count" in p.read_text()))
def test_the_exact_count_a_config_states_is_the_summary_count(path):
    """The comment users read ("Exact count: N") is what ``megaflex.model.summary`` prints for the file
    (it went stale when the defaults' parameters changed)."""
    stated = int(re.search(r"Exact count: (\d+)", (CONFIGS / path).read_text()).group(1))
    assert printed_count(summarize(load_model_config(CONFIGS / path))) == stated


def test_summary_count_for_a_map_built_with_data():
    # Performer draws its frequencies at construction (no meta build): summary must still count.
    config = ModelConfig(**BASE, attention="performer", feature_dim=16, tie_embeddings=False, mlp="swiglu")
    torch.manual_seed(0)
    assert printed_count(summarize(config)) == sum(p.numel() for p in GPT(config).parameters())


@pytest.mark.parametrize(
    "name,target",
    [
        ("flexformer_n_41m", 41e6),
        ("softmax_41m", 41e6),
        ("flexformer_n_247m", 247e6),
        ("softmax_247m", 247e6),
        ("flexformer_n_1.3b", 1.3e9),
        ("softmax_1.3b", 1.3e9),
        ("flexformer_n_7b", 7e9),
        ("flexformer_n_13b", 13e9),
    ],
)
def test_named_sizes_are_within_ten_percent(name, target):
    config = load_model_config(CONFIGS / f"{name}.yaml")
    count = build_meta_model(config).num_parameters()
    assert abs(count - target) <= 0.1 * target, f"{name}: {count:,} parameters, target {target:,.0f}"


@pytest.mark.parametrize("size", ["41m", "247m", "1.3b"])
def test_softmax_variants_differ_only_in_attention(size):
    flex = yaml.safe_load((CONFIGS / f"flexformer_n_{size}.yaml").read_text())["model"]
    soft = yaml.safe_load((CONFIGS / f"softmax_{size}.yaml").read_text())["model"]
    linear_only = {"attention", "feature_dim", "normalization", "chunk_size", "feature_kwargs", "kernel_decay"}
    assert soft["attention"] == "softmax" and flex["attention"] == "flexformer_n"
    assert {k: v for k, v in flex.items() if k not in linear_only} == {
        k: v for k, v in soft.items() if k not in linear_only
    }


def test_load_model_config_accepts_a_bare_mapping(tmp_path):
    path = tmp_path / "bare.yaml"
    path.write_text(yaml.safe_dump(BASE))
    assert load_model_config(path) == ModelConfig(**BASE)
    path.write_text(yaml.safe_dump({"model": {**BASE, "typo": 1}, "training": {"lr": 1}}))
    with pytest.raises(ValueError, match="typo"):
        load_model_config(path)


@pytest.mark.usefixtures("forked_python")
def test_summary_cli_on_the_247m_config():
    result = subprocess.run(
        [sys.executable, "-m", "megaflex.model.summary", str(CONFIGS / "flexformer_n_247m.yaml")],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
        check=True,
    )
    out = result.stdout
    assert "layers:           16" in out and "hidden:           1024" in out and "16 x head_dim 64" in out
    count = printed_count(out)
    assert count == build_meta_model(load_model_config(CONFIGS / "flexformer_n_247m.yaml")).num_parameters()
