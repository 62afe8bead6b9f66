"""The grid of ``test_attention_dispatch``: attention calls through the public entry points that exist
before and after the dispatch table (``AttentionCore``, ``causal_linear_attention``, ``LocalMixingCore``,
``windowed_linear_attention``, ``build_attention_core``), each giving its outputs and gradients.

Imports nothing from tests/ and nothing of megaflex at import time: the test runs it as a script against
the package of the commit before the move (``python attention_dispatch_cases.py OUT`` with that tree on
PYTHONPATH, TRITON_INTERPRET=1), and imports it in-process against the current one.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

import torch

B, H, D = 2, 2, 8  # batch, heads, head dim (the maps' F is 2 * 4 frequencies)
CHUNK = 8


def _windowed():  # the one-normaliser window's entry point moved from shared_window.py to window/
    try:
        from megaflex.attention.window import windowed_linear_attention
    except ImportError:
        from megaflex.attention.shared_window import windowed_linear_attention
    return windowed_linear_attention


def _qkv(n: int, seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


def _starts(n: int, *cuts: int) -> torch.Tensor:
    starts = torch.zeros(B, n, dtype=torch.bool)
    starts[:, 0] = True
    for c in cuts:
        starts[0, c] = True
    starts[1, cuts[0] + 1] = True
    return starts


def _mask(total: int) -> torch.Tensor:
    """Row 1 left-padded by two tokens."""
    mask = torch.ones(B, total, dtype=torch.bool)
    mask[1, :2] = False
    return mask


def _core(kind: str, seed: int = 0, **kwargs):
    from megaflex.attention import AttentionCore

    torch.manual_seed(seed)
    kwargs.setdefault("chunk_size", CHUNK)
    kwargs.setdefault("feature_dim", 8)
    if kind == "softmax":
        kwargs.pop("feature_dim")
    return AttentionCore(kind, H, D, **kwargs)


def _hybrid(seed: int = 0, *, window: int = 4, conv_size: int = 0, mixing: str = "shared_normaliser", **core_kwargs):
    from megaflex.attention.hybrid import LocalMixingCore

    core = _core(core_kwargs.pop("kind", "flexformer_n"), seed, **core_kwargs)
    module = LocalMixingCore(core, window=window, conv_size=conv_size, mixing=mixing)
    with torch.no_grad():  # off the identity / the even mix, so both take part in the gradients
        if module.conv_weight is not None:
            module.conv_weight.add_(0.1 * torch.randn(module.conv_weight.shape, generator=torch.Generator().manual_seed(7)))
        if module.window_mix is not None:
            module.window_mix.add_(0.3)
    return module


def _tensors(x: object) -> list[torch.Tensor]:
    """Every tensor of an output or state (dataclasses, tuples), in field order."""
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    if hasattr(x, "__dataclass_fields__"):
        return [t for name in x.__dataclass_fields__ for t in _tensors(getattr(x, name))]
    return []


def _result(out: object, leaves: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The outputs, and the gradients of the leaves under a fixed random weighting of every output."""
    outs = [t for t in _tensors(out) if t.is_floating_point()]
    result = {f"out{i}": t.detach().clone() for i, t in enumerate(outs)}
    if not torch.is_grad_enabled():
        return result
    g = torch.Generator().manual_seed(123)
    loss = sum((t * torch.randn(t.shape, generator=g, dtype=t.dtype)).sum() for t in outs if t.requires_grad)
    wanted = [leaf for leaf in leaves if leaf.requires_grad]
    grads = torch.autograd.grad(loss, wanted, allow_unused=True)
    result.update({f"grad{i}": (torch.zeros(()) if gr is None else gr) for i, gr in enumerate(grads)})
    return result


def _module_call(module, n: int = 12, seed: int = 1, dtype=torch.float32, **kwargs) -> dict[str, torch.Tensor]:
    q, k, v = _qkv(n, seed, dtype)
    module = module.to(dtype)
    out = module(q, k, v, **kwargs)
    return _result(out, [q, k, v, *module.parameters()])


def _decode(module, prefix: int, steps: int, *, grad: bool = False, key_mask: bool = False) -> dict[str, torch.Tensor]:
    """A prefill of ``prefix`` tokens, then ``steps`` more continuing its state."""
    q, k, v = _qkv(prefix + steps, 2)
    mask = _mask(prefix + steps) if key_mask else None
    out, state = module(q[:, :, :prefix], k[:, :, :prefix], v[:, :, :prefix], return_state=True,
                        key_mask=None if mask is None else mask[:, :prefix])  # fmt: skip
    with torch.set_grad_enabled(grad):
        more = module(q[:, :, prefix:], k[:, :, prefix:], v[:, :, prefix:], state=state, return_state=True, key_mask=mask)
    return _result([out, state, more], [q, k, v, *module.parameters()])


def _functional(form: str, documents: bool, backend: str = "auto") -> dict[str, torch.Tensor]:
    from megaflex.attention import causal_linear_attention

    n = 12
    g = torch.Generator().manual_seed(3)
    qf, kf, v = (torch.rand(B, H, n, 6, generator=g).requires_grad_() for _ in range(3))
    kls = torch.randn(B, H, n, generator=g).requires_grad_()
    out = causal_linear_attention(qf, kf, kls, v, form=form, chunk_size=4, backend=backend,
                                  document_starts=_starts(n, 5) if documents else None)  # fmt: skip
    return _result(out, [qf, kf, kls, v])


def _window_functional(form: str, padded: bool = False, backend: str = "auto") -> dict[str, torch.Tensor]:
    n, feat = 12, 6
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(B, H, n, D, generator=g).requires_grad_() for _ in range(3))
    qf, kf = (torch.rand(B, H, n, feat, generator=g).requires_grad_() for _ in range(2))
    qls, kls = (torch.randn(B, H, n, generator=g).requires_grad_() for _ in range(2))
    key_valid = _mask(n) if padded else None
    if padded:
        kf = kf * key_valid[:, None, :, None]
    out = _windowed()(q, qf, qls, k, kf, kls, v, window=3, form=form, chunk_size=4, key_valid=key_valid, backend=backend)
    return _result(out, [q, k, v, qf, kf, qls, kls])


def _built(**config) -> dict[str, torch.Tensor]:
    from megaflex.model import ModelConfig
    from megaflex.model.gpt import build_attention_core

    # the code before the dispatch table had no decay, today's default (auto) builds one
    undecayed = {"kernel_decay": "none"} if "kernel_decay" in ModelConfig.__dataclass_fields__ else {}
    cfg = ModelConfig(vocab_size=32, num_layers=1, hidden_size=H * D, num_heads=H, attention="elu", feature_dim=8,
                      chunk_size=CHUNK, **undecayed, **config)  # fmt: skip
    torch.manual_seed(0)
    module = build_attention_core(cfg, H)
    result = _module_call(module)
    result["module_is_wrapped"] = torch.tensor(type(module).__name__ == "LocalMixingCore")
    return result


N_LONG = 40  # > 2 segments of 8 tokens: the hybrid's segmented training path


def _segmented_hybrid():
    module = _hybrid(conv_size=2)
    module.segment_tokens = CHUNK
    return module


# name -> (the dispatch rows it is meant to reach, the computation)
CASES: dict[str, tuple[tuple[str, ...], Callable[[], dict[str, torch.Tensor]]]] = {
    "softmax_documents": (("softmax.documents",), lambda: _module_call(_core("softmax"), document_starts=_starts(12, 4, 9))),
    "softmax_padded": (("softmax.cached",), lambda: _module_call(_core("softmax"), key_mask=_mask(12))),
    "softmax_decode": (("softmax.cached",), lambda: _decode(_core("softmax"), 9, 1)),
    "elu_documents_state": (("linear.documents.per_document", "linear.chunk.torch"),
                            lambda: _module_call(_core("elu"), document_starts=_starts(12, 4, 9), return_state=True)),
    "elu_documents_batched": (("linear.documents.batched", "linear.chunk.torch"),
                              lambda: _module_call(_core("elu"), document_starts=_starts(12, 4, 9))),
    "elu_decode_step": (("linear.decode.step",), lambda: _decode(_core("elu"), 9, 1)),
    "elu_decode_scan_padded": (("linear.decode.scan",), lambda: _decode(_core("elu"), 9, 3, key_mask=True)),
    "fn_decode_with_grad": (("linear.recurrent",), lambda: _decode(_core("flexformer_n"), 9, 3, grad=True)),
    "elu_quadratic": (("linear.quadratic",), lambda: _module_call(_core("elu", form="quadratic"))),
    "fn_recurrent": (("linear.recurrent",), lambda: _module_call(_core("flexformer_n", form="recurrent"))),
    "functional_quadratic_documents": (("linear.quadratic",), lambda: _functional("quadratic", True)),
    "functional_recurrent_documents": (("linear.recurrent",), lambda: _functional("recurrent", True)),
    "functional_chunked_documents": (("linear.chunk.by_document", "linear.chunk.torch"), lambda: _functional("chunked", True)),
    "functional_chunked_triton": (("linear.chunk.triton",), lambda: _functional("chunked", False, "triton")),
    "fn_triton": (("linear.chunk.triton_trig",), lambda: _module_call(_core("flexformer_n", backend="triton"))),
    "elu_triton": (("linear.chunk.triton",), lambda: _module_call(_core("elu", backend="triton"))),
    "fn_triton_padded": (("linear.chunk.triton",), lambda: _module_call(_core("flexformer_n", backend="triton"), key_mask=_mask(12))),
    "fn_torch_cpu": (("linear.chunk.torch_trig_cpu",), lambda: _module_call(_core("flexformer_n"))),
    "fn_torch_cpu_long": (("linear.chunk.torch_trig_cpu",), lambda: _module_call(_core("flexformer_n"), n=200)),
    "fn_torch_padded": (("linear.chunk.torch",), lambda: _module_call(_core("flexformer_n"), key_mask=_mask(12))),
    "elu_torch_fp64": (("linear.chunk.torch",), lambda: _module_call(_core("elu"), dtype=torch.float64)),
    "hybrid_conv_only": (("local_mixing.core",), lambda: _module_call(_hybrid(window=0, conv_size=3))),
    "hybrid_gated_documents": (("local_mixing.core", "linear.documents.batched"),
                               lambda: _module_call(_hybrid(mixing="gated", conv_size=2), document_starts=_starts(12, 4, 9))),
    "hybrid_gated_padded_decode": (("local_mixing.core",), lambda: _decode(_hybrid(mixing="gated", conv_size=2), 9, 2, key_mask=True)),
    "hybrid_documents": (("local_mixing.documents", "local_mixing.shared"),
                         lambda: _module_call(_hybrid(conv_size=2), document_starts=_starts(12, 4, 9))),
    "hybrid_segments": (("local_mixing.segments", "window.chunk.torch"), lambda: _module_call(_segmented_hybrid(), n=N_LONG)),
    "hybrid_shared": (("local_mixing.shared", "window.chunk.torch"), lambda: _module_call(_hybrid(conv_size=2))),
    "hybrid_shared_fp64": (("window.chunk.torch",), lambda: _module_call(_hybrid(), dtype=torch.float64)),
    "hybrid_decode": (("window.recurrent",), lambda: _decode(_hybrid(), 9, 3)),
    "hybrid_padded": (("window.chunk.padded",), lambda: _module_call(_hybrid(), key_mask=_mask(12))),
    "hybrid_quadratic": (("window.quadratic",), lambda: _module_call(_hybrid(form="quadratic"))),
    "hybrid_triton": (("window.chunk.triton",), lambda: _module_call(_hybrid(backend="triton"))),
    "hybrid_softmax_core": (("local_mixing.shared",), lambda: _module_call(_hybrid(kind="softmax"))),
    "window_fn_quadratic": (("window.quadratic",), lambda: _window_functional("quadratic")),
    "window_fn_recurrent": (("window.recurrent",), lambda: _window_functional("recurrent")),
    "window_fn_padded": (("window.chunk.padded",), lambda: _window_functional("chunked", padded=True)),
    "window_fn_fla": (("window.chunk.torch",), lambda: _window_functional("chunked", backend="fla")),
    "window_fn_triton": (("window.chunk.triton",), lambda: _window_functional("chunked", backend="triton")),
    "built_core": (("module.core",), lambda: _built()),
    "built_hybrid": (("module.local_mixing",), lambda: _built(softmax_window=4, qkv_conv_size=2)),
}


def _bidirectional(module, reference_form: str | None = "quadratic", **kwargs) -> Callable[[], dict[str, torch.Tensor]]:
    """A bidirectional call of ``module`` and, with ``reference_form``, the same module run in that form."""

    def run(form: str | None = None) -> dict[str, torch.Tensor]:
        core = getattr(module, "core", module)
        configured = core.form
        if form is not None:
            core.form = form
        try:
            return _module_call(module, **kwargs)
        finally:
            core.form = configured

    run.reference = (lambda: run(reference_form)) if reference_form else None
    return run


def _bidirectional_softmax_reference() -> dict[str, torch.Tensor]:
    """SDPA over every real key, written out: the reference of the "softmax.bidirectional" row."""
    import math

    q, k, v = _qkv(12, 1)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~_mask(12)[:, None, None, :], float("-inf"))
    return _result(torch.softmax(scores, dim=-1) @ v, [q, k, v])


def bidirectional_cases() -> dict[str, tuple[tuple[str, ...], Callable, Callable | None, object]]:
    """name -> (rows, computation, its reference or None, the module): the bidirectional rows, which the
    commit before the dispatch table did not have, are checked against their references (within rounding)
    instead. Called in-process only (the old package has no ``causal``)."""
    padded = dict(key_mask=_mask(12))
    modules = {
        "bidi_fn": (("linear.bidirectional.global",), _core("flexformer_n", causal=False), "quadratic", padded),
        "bidi_elu_quadratic": (("linear.bidirectional.quadratic",), _core("elu", causal=False, form="quadratic"),
                               "chunked", padded),
        "bidi_hybrid": (("local_mixing.bidirectional", "window.bidirectional.blocks"), _hybrid(causal=False),
                        "quadratic", padded),
        "bidi_hybrid_quadratic": (("window.bidirectional.quadratic",), _hybrid(causal=False, form="quadratic"),
                                  "chunked", {}),
    }
    out = {}
    for name, (rows, module, reference, kwargs) in modules.items():
        fn = _bidirectional(module, reference, **kwargs)
        out[name] = (rows, fn, fn.reference, module)
    softmax = _core("softmax", causal=False)
    out["bidi_softmax"] = (("softmax.bidirectional",), lambda: _module_call(softmax, **padded),
                           _bidirectional_softmax_reference, softmax)
    out["bidi_built"] = (("module.core",), lambda: _built(causal=False), None, None)
    out["bidi_built_hybrid"] = (("module.local_mixing", "local_mixing.bidirectional"),
                                lambda: _built(causal=False, softmax_window=4), None, None)
    return out


def run_all() -> dict[str, dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    return {name: fn() for name, (_, fn) in CASES.items()}


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "the Triton rows run on CPU under the interpreter"
    import megaflex

    torch.save({"package": megaflex.__file__, "grid": run_all()}, sys.argv[1])
