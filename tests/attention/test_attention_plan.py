"""Issue 48: attention planned once at build with real imports (``attention/plan.py``).

What the build decides is resolved there: the chunked forms on each device are imported functions
(no strings, no importlib), the refusals a module's settings meet are raised when it is built, and the
inspectable list (``dispatch.ROWS``) is gathered from the forms the modules call, in agreement with what
their plain code picks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from megaflex.attention import AttentionCore, dispatch
from megaflex.attention.dispatch import OPS, ROWS, RefusedAttention, Request, select
from megaflex.attention.hybrid import LocalMixingCore, build_attention
from megaflex.attention.linear.chunk import chunked_linear_attention
from megaflex.attention.linear.chunk_trig import trig_linear_attention_chunked
from megaflex.attention.plan import chunked_forms
from megaflex.attention.triton import TritonWindowNumerator, trig_linear_attention, triton_linear_attention
from megaflex.model import GPT, ModelConfig

ATTENTION = Path(__file__).resolve().parents[2] / "megaflex" / "attention"
H, D = 2, 8
MODEL = dict(vocab_size=37, num_layers=2, hidden_size=16, num_heads=2, feature_dim=8, chunk_size=4, max_seq_len=32)


def _core(**kwargs: object) -> AttentionCore:
    return AttentionCore("flexformer_n", H, D, feature_dim=8, chunk_size=4, **kwargs)


# ----------------------------------------------------------------------------- real imports
def test_no_attention_module_imports_by_string() -> None:
    """No importlib and no "module:function" targets anywhere in the attention package."""
    for path in sorted(ATTENTION.rglob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                    for alias in node.names} | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "importlib" not in imported, path
        targets = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
                   and node.value.startswith("megaflex.attention.") and ":" in node.value]  # fmt: skip
        assert not targets, (path, targets)


def test_the_default_core_plans_its_chunked_kernels_as_functions() -> None:
    """The default model's core (Flexformer_n, backend auto): the fused trig kernel on each device."""
    plan = _core(normalization="capped_denominator").plan
    assert plan.chunked_on("cuda").fused.fn is trig_linear_attention
    assert plan.chunked_on("cuda").features.fn is triton_linear_attention
    assert plan.chunked_on("cpu").fused.fn is trig_linear_attention_chunked
    assert plan.chunked_on("cpu").features.fn is chunked_linear_attention
    assert plan.chunked_on("mps").fused is None and plan.chunked_on("mps").features.fn is chunked_linear_attention
    assert plan.refusal is None


def test_setting_form_or_backend_plans_again() -> None:
    core = _core()
    core.backend = "torch"
    assert core.plan.backend == "torch" and core.plan.chunked_on("cuda").features.fn is chunked_linear_attention
    core.form = "quadratic"
    assert core.plan.algorithm == "quadratic"


# ----------------------------------------------------------------------------- the derived list
def test_rows_are_gathered_from_the_modules_forms() -> None:
    names = [row.name for row in ROWS]
    assert len(names) == len(set(names))
    assert OPS == tuple(dict.fromkeys(row.op for row in ROWS))
    for row in ROWS:
        assert callable(row.fn) and row.implementation() is row.fn
        assert row.target == f"{row.fn.__module__}:{row.fn.__qualname__}"
    assert select(Request("window", backend="triton", window=3)).fn is TritonWindowNumerator


@pytest.mark.parametrize("backend", ["auto", "torch", "triton", "fla"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("trig,padded", [(False, False), (True, False), (True, True)])
def test_the_planned_chunked_form_is_the_row_the_list_names(backend: str, device: str, trig: bool, padded: bool) -> None:
    """What ``AttentionCore._linear`` runs for a chunked call (fused when the map is trig and no key is
    padded) agrees with ``select`` over the list, on both devices (CUDA checked without a GPU)."""
    forms = chunked_forms(backend, device)
    planned = forms.fused if forms.fused is not None and trig and not padded else forms.features
    assert planned is select(Request("linear", backend=backend, device=device, trig=trig, padded=padded))


def test_a_call_records_the_rows_it_runs() -> None:
    q, k, v = (torch.randn(1, H, 8, D) for _ in range(3))
    with dispatch.recording() as seen:
        _core()(q, k, v)
    assert [row.name for _, row in seen] == ["linear.chunk.torch_trig_cpu"]


# ----------------------------------------------------------------------------- refusals at build
@pytest.mark.parametrize("build, message", [
    (lambda: LocalMixingCore(_core(causal=False), window=3, mixing="gated"), "window_mixing: .*'shared_normaliser'"),
    (lambda: LocalMixingCore(_core(causal=False), window=3, conv_size=2), "qkv_conv_size: .*qkv_conv_size=0"),
    (lambda: LocalMixingCore(_core(causal=False, decay="learned"), window=3), "kernel_decay: .*kernel_decay='none'"),
    (lambda: LocalMixingCore(_core(causal=False, form="recurrent"), window=3), "form: 'recurrent' .*'chunked'"),
    (lambda: build_attention(_core(causal=False, form="recurrent")), "form: 'recurrent' .*'chunked'"),
    (lambda: build_attention(_core(causal=False), conv_size=2), "qkv_conv_size: .*qkv_conv_size=0"),
])  # fmt: skip
def test_construction_refusals_are_raised_at_build(build, message: str) -> None:
    """Before any call: the same one-line message the first forward used to raise."""
    with pytest.raises(RefusedAttention, match=message) as err:
        build()
    assert "causal=True" in str(err.value) and "\n" not in str(err.value)


def test_a_model_built_with_a_refused_setting_raises_at_construction() -> None:
    """A bidirectional model with the causal-only decay: refused by the config check, and (a config changed after
    its check) while the model is built, not at step 1."""
    with pytest.raises(RefusedAttention, match="kernel_decay: .*kernel_decay='none'"):
        ModelConfig(**MODEL, causal=False, kernel_decay="learned")
    config = ModelConfig(**MODEL, causal=False)
    config.kernel_decay = "learned"
    with pytest.raises(RefusedAttention, match="kernel_decay: .*kernel_decay='none'"):
        GPT(config)
    GPT(ModelConfig(**MODEL, kernel_decay="learned"))  # the causal model with the same setting is built


def test_a_bare_core_keeps_its_refusal_for_the_first_call() -> None:
    """A core alone (no model around it) is still built, so that a reference can read its settings; its
    first call raises, after the calls' own refusals (a state asked of a bidirectional core)."""
    core = _core(causal=False, decay="learned")
    assert core.plan.refusal is not None and core.plan.refusal.name == "bidirectional.decay"
    x = torch.randn(1, H, 4, D)
    with pytest.raises(RefusedAttention, match="return_state: "):
        core(x, x, x, return_state=True)
    with pytest.raises(RefusedAttention, match="kernel_decay: "):
        core(x, x, x)
