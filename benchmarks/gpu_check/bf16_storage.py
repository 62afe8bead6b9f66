"""Does bf16 storage of the kernel parameters matter? (``precision_41m``'s ``bf16_storage`` field)

Under ``train.precision=bf16`` DeepSpeed 0.19 casts every parameter of the module to bf16
(``engine._cast_module_mixed_precision``; its ``keep_in_fp32_modules`` keeps buffers only), and
its bf16 / ZeRO optimizers keep the fp32 master copy of every parameter and apply the updates
there. So Omega and tau lose nothing across steps; what bf16 storage changes is the value the
forward and backward read: the fp32 master rounded to bf16 (the Triton kernels then read Omega in
fp32, ``triton/trig.py``). Keeping those two in fp32 inside the engine would need parameters of two
dtypes in one DeepSpeed bf16 optimizer, whose flat groups take one dtype; so this measures instead.

On one model and batch, all in fp32 with the torch attention path (true fp32 matmuls: the effect
measured is the rounding, not tf32's), the loss and the gradient with (a) only the kernel
parameters rounded to bf16, (b) only the other parameters rounded, (c) all of them, against the
unrounded model: relative loss change and 1 - cosine of the whole gradient. ``passed``: rounding
the kernel parameters turns the gradient no more than rounding the other weights does (which bf16
training accepts by construction). The gradient is the measure: at initialisation the loss moves
by a few fp32 ulps either way (on tiny.yaml on CPU: 1 - cosine 4e-9 kernel vs 8e-6 other).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROLES = ("frequencies", "temperature")  # Omega and tau (the map_weight role is a plain projection)


def bf16_storage_effect(config: Path, seq_len: int, batch: int, device: str, seed: int = 0) -> dict[str, Any]:
    import torch

    from megaflex.attention import named_kernel_parameters
    from megaflex.model.gpt import GPT
    from megaflex.training.config import load_config

    cfg = load_config([config], [f"data.seq_len={seq_len}", f"model.max_seq_len={seq_len}", "model.attention_backend=torch"])
    torch.manual_seed(seed)
    model = GPT(cfg.model).to(device=device, dtype=torch.float32)
    kernel = {id(kp.param) for _, kp in named_kernel_parameters(model) if kp.role in ROLES}
    names = {n: ("kernel" if id(p) in kernel else "other") for n, p in model.named_parameters()}
    master = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, cfg.model.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(seed + 1))
    ids = ids.to(device)

    def loss_and_grad(rounded: set[str]) -> tuple[float, torch.Tensor]:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(master[n].to(torch.bfloat16).float() if names[n] in rounded else master[n])
        model.zero_grad(set_to_none=True)
        loss = model(ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        grad = torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])
        return loss.item(), grad

    exact_loss, exact_grad = loss_and_grad(set())
    result: dict[str, Any] = {"kernel_parameters": sum(1 for v in names.values() if v == "kernel"), "loss": exact_loss}
    for label, rounded in (("kernel_params_bf16", {"kernel"}), ("other_params_bf16", {"other"}), ("all_params_bf16", {"kernel", "other"})):
        loss, grad = loss_and_grad(rounded)
        result[label] = {
            "loss_rel_change": abs(loss - exact_loss) / abs(exact_loss),
            "grad_one_minus_cosine": 1.0 - float(torch.nn.functional.cosine_similarity(grad, exact_grad, dim=0)),
        }
    result["passed"] = result["kernel_params_bf16"]["grad_one_minus_cosine"] <= result["other_params_bf16"]["grad_one_minus_cosine"]
    return result
