"""The model with ``attention_backend='triton'`` forced on CPU tensors (Triton interpreter) equals
``attention_backend='torch'``: forward logits and every parameter gradient, for the fused trig
path (flexformer_n, flexformer_s) and a non-trig map (performer positive) whose features are
computed in torch before the same kernels; plus the backend's dispatch rules and errors."""

from __future__ import annotations

import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported (CPU tensors need it)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install 'megaflex[dev]' installs it)")

from attention_helpers import form_steps  # noqa: E402
from megaflex.attention import AttentionCore  # noqa: E402
from megaflex.attention.core import chunked_backend  # noqa: E402
from megaflex.model import GPT, ModelConfig  # noqa: E402
from numerics import assert_close, gpt_steps, normwise_scale  # noqa: E402

pytestmark = pytest.mark.numerics

VOCAB = 97


def _model(attention: str, backend: str, normalization: str = "rms", **feature_kwargs) -> GPT:
    config = ModelConfig(
        vocab_size=VOCAB, num_layers=2, hidden_size=32, num_heads=2, ffn_hidden_size=64, attention=attention,
        feature_dim=16, chunk_size=16, max_seq_len=64, init_std=0.2, attention_backend=backend, feature_kwargs=feature_kwargs,
        normalization=normalization,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT(config).train()


def _forward_backward(model: GPT, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "attention,feature_kwargs,normalization",
    [("flexformer_n", {}, "rms"), ("flexformer_s", {}, "rms"), ("performer", {"variant": "positive"}, "rms"),
     ("flexformer_n", {}, "capped_denominator")],
)
def test_model_triton_backend_equals_torch_backend(attention, feature_kwargs, normalization):
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    logits_torch, grads_torch = _forward_backward(_model(attention, "torch", normalization, **feature_kwargs), ids)
    logits_triton, grads_triton = _forward_backward(_model(attention, "triton", normalization, **feature_kwargs), ids)
    assert logits_torch.std() > 0.3  # attention matters at this init
    config = _model(attention, "torch", normalization, **feature_kwargs).config
    assert_close(logits_triton, logits_torch, steps=gpt_steps(config, 40), name="logits")
    assert grads_triton.keys() == grads_torch.keys() and any("omega" in name or "tau" in name for name in grads_torch) == (
        attention.startswith("flexformer")
    )
    # parameter gradients also sum over every (batch, token) position; their rounding scales with
    # the terms, so all are compared on the largest gradient's scale
    steps = gpt_steps(config, 40, backward=True) + 2 * ids.numel()
    terms = max(normwise_scale(g) for g in grads_torch.values())
    for name, grad in grads_torch.items():
        assert_close(grads_triton[name], grad, steps=steps, floor=terms, name=f"d{name}")


def test_auto_uses_triton_only_on_cuda_and_torch_never():
    assert chunked_backend("auto", on_cuda=True) == "triton" and chunked_backend("auto", on_cuda=False) == "torch"
    assert chunked_backend("triton", on_cuda=False) == "triton" and chunked_backend("torch", on_cuda=True) == "torch"
    with pytest.raises(ValueError, match="attention_backend: expected one of"):
        AttentionCore("flexformer_n", 2, 8, backend="cuda")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        ModelConfig(vocab_size=VOCAB, num_layers=1, hidden_size=16, num_heads=2, attention_backend="fast")


def test_decoding_keeps_the_recurrent_step_with_the_triton_backend():
    """Prefill through the kernels, then token-by-token decoding from the carried state."""
    torch.manual_seed(0)
    cores = {backend: AttentionCore("flexformer_n", 2, 8, feature_dim=16, chunk_size=16, backend=backend) for backend in ("torch", "triton")}
    cores["triton"].load_state_dict(cores["torch"].state_dict())
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 21, 8, generator=g) for _ in range(3))
    steps = form_steps(cores["torch"].feature_map, q, k, v)
    with torch.no_grad():
        for backend, core in cores.items():
            _, state = core(q[:, :, :20], k[:, :, :20], v[:, :, :20], return_state=True)
            out, _ = core(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], state=state, return_state=True)
            cores[backend] = out
    assert_close(cores["triton"], cores["torch"], steps=steps)


def test_triton_backend_on_cpu_without_the_interpreter_is_a_clear_error():
    code = (
        "import torch\n"
        "from megaflex.attention.triton import triton_linear_attention\n"
        "x = torch.rand(1, 1, 4, 16)\n"
        "triton_linear_attention(x, x, None, x)\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "set TRITON_INTERPRET=1" in proc.stderr


def _largest_saved_numel(core: AttentionCore, q, k, v) -> int:
    """Elements of the largest tensor autograd keeps for backward across ``core``'s forward."""
    sizes = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        core(q, k, v)
    return max(sizes)


def test_trig_path_keeps_no_features_alive_for_backward():
    """With backend=triton the flexformer_n layer saves nothing of size [B, H, N, F] (F = 4 d here),
    only inputs-sized tensors; the torch backend's fused map does save features (the check can fail)."""
    batch, heads, n, d, feat = 2, 2, 40, 8, 32
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(batch, heads, n, d, generator=g).requires_grad_() for _ in range(3))
    features_numel = batch * heads * n * feat
    torch.manual_seed(0)
    triton_core = AttentionCore("flexformer_n", heads, d, feature_dim=feat, chunk_size=16, backend="triton")
    torch_core = AttentionCore("flexformer_n", heads, d, feature_dim=feat, chunk_size=16, backend="torch")
    assert _largest_saved_numel(torch_core, q, k, v) >= features_numel
    assert _largest_saved_numel(triton_core, q, k, v) == batch * heads * n * d  # q, k, v themselves
