"""``train.compile``: torch.compile each transformer block on its own (torchtitan's per-block compile).

    compile_blocks(model)   # in place, before DeepSpeed wraps the model

Each ``Block`` is compiled with ``nn.Module.compile`` (in place: the module keeps its parameters and
state-dict keys, no ``_orig_mod.`` prefix, so checkpoints move freely between compiled and eager runs).
All blocks share one code object and torch inlines built-in modules (parameters are graph inputs, not
constants), so one compiled graph serves every block: compile time does not grow with the depth.

The attention core stays eager: each block's ``Attention.run_attention`` becomes the
``torch.compiler.disable``d ``gpt.call_attention_core``, a documented graph break, so a block compiles as
two graphs around it (norm, fused QKV and RoPE before; output gain and projection, residual, norm and MLP
after) and the core's autograd Functions, Triton kernels and dispatch never meet the compiler. The
embedding, the final norm and the loss run eagerly as before.
"""

from __future__ import annotations

from typing import Any

import torch

from megaflex.model.gpt import GPT, call_attention_core


def compile_blocks(model: GPT, **options: Any) -> GPT:
    """Compile every block of ``model`` in place (``options``: ``torch.compile``'s); returns ``model``."""
    eager_core = torch.compiler.disable(call_attention_core)  # imports the compiler: only when asked for
    for block in model.blocks:
        block.attn.run_attention = eager_core
        block.compile(**options)
        if block._compiled_call_impl == block._call_impl:  # torch.compile gave the function back: switched off
            raise RuntimeError("torch.compile is disabled in this process (TORCHDYNAMO_DISABLE=1 or "
                               "TORCH_COMPILE_DISABLE=1): the blocks would run eagerly")
    return model


def compiled_blocks(model: torch.nn.Module) -> int:
    """How many submodules of ``model`` run compiled (``nn.Module.compile``)."""
    return sum(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
