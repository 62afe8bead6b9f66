"""``DeepSpeedMPU`` inside DeepSpeed: TP=2 x DP=2 gradient norms equal the single-device norm.

DeepSpeed reduces grad norms over the model-parallel group, counting a parameter on every
rank only when it is tagged ``tensor_model_parallel`` (others only on model-parallel rank 0),
and averages gradients over the data-parallel group: so the adapter's groups and the tags
(including the feature maps', added by ``mark_head_sharded_params`` in ``parallelize_gpt``) must all be right.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from megaflex.model.config import ModelConfig
from megaflex.model.gpt import GPT
from numerics import assert_close, gpt_steps, norm_steps

CONFIG = dict(vocab_size=301, num_layers=1, hidden_size=32, num_heads=4, attention="flexformer_n",
              feature_dim=16, chunk_size=8, max_seq_len=64, tie_embeddings=False)
SEQ = 11


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 301, (2, SEQ), generator=gen), torch.randint(0, 301, (2, SEQ), generator=gen)


def _ds_worker(rank: int, world: int, ref_state: dict, zero_stage: int) -> dict:
    import deepspeed
    from deepspeed.runtime.utils import clip_grad_norm_

    from megaflex.parallel import DeepSpeedMPU, ParallelState, mark_head_sharded_params, parallelize_gpt
    from megaflex.checkpoint.reshard import gpt_layout, load_state_dict_checked, split_state_dict

    from megaflex.training.deepspeed_config import init_deepspeed_distributed

    init_deepspeed_distributed("gloo")  # adopts the existing process group
    state = ParallelState.create(tensor_parallel_size=2)
    config = ModelConfig(**CONFIG)
    model = parallelize_gpt(GPT(config), state, seed=0)
    load_state_dict_checked(model, split_state_dict(ref_state, gpt_layout(config), 2)[state.tp_rank])
    mpu = DeepSpeedMPU(state)
    ids, labels = _batch()

    # DeepSpeed's own fp32 clipping norm, straight from the model's gradients; without the
    # feature-map tags the TP rank 1 halves of Omega/tau are left out.
    model(ids, labels=labels).loss.backward()
    feature_map = [p for name, p in model.named_parameters() if ".feature_map." in name]
    assert all(p.tensor_model_parallel and p.partition_dim == 0 for p in feature_map)  # tagged by parallelize_gpt
    for p in feature_map:
        p.tensor_model_parallel = False  # as an untagged model would be
    untagged_fm_norm = float(clip_grad_norm_(feature_map, max_norm=1e9, mpu=mpu))
    assert mark_head_sharded_params(model) == 3  # omega1, omega2, tau of the single layer
    fm_norm = float(clip_grad_norm_(feature_map, max_norm=1e9, mpu=mpu))
    plain_norm = float(clip_grad_norm_(list(model.parameters()), max_norm=1e9, mpu=mpu))
    model.zero_grad(set_to_none=True)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 2 * state.dp_size,
        "gradient_clipping": 1e9,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config, mpu=mpu,
                                           dist_init_required=False)
    loss = engine(ids, labels=labels).loss
    engine.backward(loss)
    engine.step()
    return {"untagged_fm_norm": untagged_fm_norm, "fm_norm": fm_norm, "plain_norm": plain_norm, "engine_norm": engine.get_global_grad_norm(), "loss": loss.item()}


@pytest.mark.slow
@pytest.mark.numerics
def test_deepspeed_grad_norm_with_tp2_dp2_equals_tp1() -> None:
    torch.manual_seed(0)
    model = GPT(ModelConfig(**CONFIG))
    ids, labels = _batch()
    out = model(ids, labels=labels)
    out.loss.backward()
    ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
    ref_fm_norm = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for name, p in model.named_parameters() if ".feature_map." in name])).item()
    ref_state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    # error growth (tests/numerics.py): the model, the loss's token and vocabulary sums, the TP and DP
    # all-reduces; gradients also sum over every (batch, token) position, each on its own scale (the
    # feature maps' are ~1e-5, the head's ~0.2: the norm of theirs must tell half of them missing)
    config, tokens = ModelConfig(**CONFIG), ids.numel()
    steps = gpt_steps(config, SEQ) + tokens + config.vocab_size + 4
    grad_steps = gpt_steps(config, SEQ, backward=True) + 2 * (tokens + config.vocab_size + 4)
    fm_steps = norm_steps(grad_steps, [p.grad for n, p in model.named_parameters() if ".feature_map." in n], ref_fm_norm)
    all_steps = norm_steps(grad_steps, [p.grad for p in model.parameters()], ref_norm)
    results = run_distributed(_ds_worker, 4, args=(ref_state, 1))
    for res in results:
        assert_close(torch.tensor(res["loss"]), out.loss.detach(), steps=steps, name="loss")
        # untagged, TP rank 1's heads are dropped from the norm: why mark_head_sharded_params exists
        assert res["untagged_fm_norm"] < ref_fm_norm * (1 - 1e-3)
        assert_close(torch.tensor(res["fm_norm"]), torch.tensor(ref_fm_norm), steps=fm_steps, name="feature-map norm")
        assert_close(torch.tensor(res["plain_norm"]), torch.tensor(ref_norm), steps=all_steps, name="norm")
        # ZeRO-1 over the DP group
        assert_close(torch.tensor(float(res["engine_norm"])), torch.tensor(ref_norm), steps=all_steps, name="engine norm")
