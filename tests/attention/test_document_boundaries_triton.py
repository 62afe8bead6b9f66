"""Document boundaries through the Triton backend (Triton's interpreter on CPU tensors): a packed
batch gives the outputs and gradients of its documents run separately, for a trig map (the fused
``trig_linear_attention``) and a map whose features are computed in torch."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported (CPU tensors need it)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install 'megaflex[dev]' installs it)")

from megaflex.attention import AttentionCore  # noqa: E402
from attention_helpers import form_steps  # noqa: E402
from test_document_boundaries import (  # noqa: E402
    HEADS, HEAD_DIM, core_attend, packed_vs_separate, random_inputs, some_state,
)


@pytest.mark.parametrize("kind,carried", [("flexformer_n", False), ("elu", True)])
def test_triton_backend_restarts_at_each_document(kind: str, carried: bool) -> None:
    """The documents batched into Triton calls (the first of a row from the carried state when given)."""
    torch.manual_seed(0)
    core = AttentionCore(kind, HEADS, HEAD_DIM, feature_dim=16, chunk_size=16, backend="triton")
    q, k, v, _ = random_inputs(32)
    state = some_state(core.feature_map.feature_dim) if carried else None
    steps = form_steps(core.feature_map, q, k, v, extra_tokens=1)
    packed_vs_separate(core_attend(core), list(core.parameters()), steps, state, name=kind)
