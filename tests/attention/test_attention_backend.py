"""One dispatcher for the chunked form (``core.chunked_backend``) and ``model.attention_backend``
end to end: the config key reaches every attention layer, and "fla" (flash-linear-attention's
``chunk_simple_gla``) fails with one clear error where it cannot run (no fla, or CPU tensors)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from megaflex.attention import ATTENTION_BACKENDS, AttentionCore, causal_linear_attention
from megaflex.attention.core import chunked_backend
from megaflex.model import GPT, ModelConfig
from megaflex.training.config import load_config

REPO_ROOT = Path(__file__).resolve().parents[2]
FLA_INSTALLED = importlib.util.find_spec("fla") is not None
FLA_ERROR = "runs on CUDA tensors only" if FLA_INSTALLED else "needs flash-linear-attention"


@pytest.mark.parametrize(
    "backend,on_cuda,expected",
    [("auto", True, "triton"), ("auto", False, "torch"), ("torch", True, "torch"), ("triton", False, "triton"), ("fla", True, "fla"), ("fla", False, "fla")],
)
def test_chunked_backend_is_the_one_decision(backend, on_cuda, expected):
    assert chunked_backend(backend, on_cuda) == expected


def test_unknown_backend_is_rejected_everywhere():
    assert ATTENTION_BACKENDS == ("auto", "torch", "triton", "fla")
    with pytest.raises(ValueError, match="attention_backend: expected one of"):
        chunked_backend("cuda", True)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        ModelConfig(vocab_size=11, num_layers=1, hidden_size=16, num_heads=2, attention_backend="flash")


def test_config_key_reaches_every_attention_layer():
    config = load_config([REPO_ROOT / "configs" / "tiny.yaml"], ["model.attention_backend=fla"])
    assert config.model.attention_backend == "fla"
    model = GPT(config.model)
    cores = [m for m in model.modules() if isinstance(m, AttentionCore)]
    assert len(cores) == config.model.num_layers and all(core.backend == "fla" for core in cores)


def test_fla_backend_on_cpu_is_one_clear_error():
    g = torch.Generator().manual_seed(0)
    qf, kf, v = (torch.rand(1, 2, 8, 4, generator=g) for _ in range(3))
    with pytest.raises(RuntimeError, match=FLA_ERROR):
        causal_linear_attention(qf, kf, None, v, backend="fla")
    core = AttentionCore("flexformer_n", 2, 8, feature_dim=16, chunk_size=16, backend="fla")
    q, k, vv = (torch.randn(1, 2, 20, 8, generator=g) for _ in range(3))
    with pytest.raises(RuntimeError, match=FLA_ERROR):
        core(q, k, vv)
    # the other forms never touch the chunked backend
    out, _ = causal_linear_attention(qf, kf, None, v, form="recurrent", backend="fla")
    ref, _ = causal_linear_attention(qf, kf, None, v, form="quadratic")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
