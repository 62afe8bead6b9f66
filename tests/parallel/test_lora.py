"""LoRA adapters (``megaflex.parallel.lora``): identity at start, exact merge, only adapters train,
TP=2 (and DeepSpeed ZeRO 0/2 under it) equals TP=1, clear errors."""

from __future__ import annotations

import copy

import pytest
import torch

from distributed import run_distributed
from megaflex.model.config import ModelConfig
from megaflex.model.gpt import GPT
from megaflex.parallel import ParallelState, parallelize_gpt
from megaflex.parallel.lora import LoRAAdapter, add_lora, lora_parameters, merge_lora
from megaflex.checkpoint.reshard import ShardSpec, derive_layout, gpt_layout, load_state_dict_checked, merge_shards, split_state_dict
from megaflex.training.optim import param_groups
from numerics import assert_close, gpt_steps, norm_steps, normwise_scale

VOCAB = 301  # not divisible by 2
SEQ = 13  # not a multiple of the chunk size
RANK, ALPHA = 3, 6.0
CONFIGS = {
    # Flexformer-N with its per-head gain, tied embeddings, GELU, no bias
    "flex": dict(vocab_size=VOCAB, num_layers=2, hidden_size=32, num_heads=4, attention="flexformer_n",
                 feature_dim=16, chunk_size=8, max_seq_len=64),
    # softmax teacher-like model: biases, SwiGLU, untied head
    "softmax": dict(vocab_size=VOCAB, num_layers=2, hidden_size=32, num_heads=4, attention="softmax",
                    max_seq_len=64, bias=True, mlp="swiglu", tie_embeddings=False),
}
ALL_TARGETS = ("qkv", "proj", "fc_in", "fc_out")


def _batch(seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (2, seq), generator=gen), torch.randint(0, VOCAB, (2, seq), generator=gen)


def _randomize_b(model: torch.nn.Module, seed: int = 7) -> None:
    """Give every B a non-zero value (drawn in module order, independent of TP)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRAAdapter):
                m.B.copy_(0.05 * torch.randn(m.B.shape, generator=gen))


def _lora_model(name: str, targets=("qkv", "proj"), seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(ModelConfig(**CONFIGS[name]))
    add_lora(model, RANK, ALPHA, targets)
    return model


def _lora_layout(config: ModelConfig, targets) -> dict[str, ShardSpec]:
    def build(state):
        model = parallelize_gpt(GPT(config), state, seed=0)
        add_lora(model, RANK, ALPHA, targets)
        return model
    return derive_layout(build)


# ----------------------------------------------------------------------------------------
# single process
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,targets", [("flex", ("qkv", "proj")), ("softmax", ALL_TARGETS)])
def test_add_lora_leaves_the_output_unchanged(name: str, targets) -> None:
    torch.manual_seed(0)
    model = GPT(ModelConfig(**CONFIGS[name]))
    ids, _ = _batch()
    with torch.no_grad():
        before = model(ids).logits
        add_lora(model, RANK, ALPHA, targets)
        after = model(ids).logits
    assert torch.equal(before, after)
    adapters = [m for m in model.modules() if isinstance(m, LoRAAdapter)]
    assert len(adapters) == len(targets) * model.config.num_layers
    assert all(torch.all(a.B == 0) and a.A.abs().max() > 0 for a in adapters)


def test_only_lora_parameters_require_grad() -> None:
    torch.manual_seed(0)
    model = GPT(ModelConfig(**CONFIGS["softmax"]))
    params = add_lora(model, RANK, ALPHA, ALL_TARGETS)
    assert [id(p) for p in params] == [id(p) for p in lora_parameters(model)]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [n for n, _ in model.named_parameters() if n.endswith((".lora.A", ".lora.B"))]
    assert len(trainable) == 2 * len(ALL_TARGETS) * model.config.num_layers == len(params)
    assert "blocks.1.attn.qkv.lora.A" in trainable and "blocks.0.mlp.fc_out.lora.B" in trainable
    # the optimizer groups of the trainer see only the adapters
    grouped = [p for g in param_groups(model, 0.1) for p in g["params"]]
    assert {id(p) for p in grouped} == {id(p) for p in params}


@pytest.mark.parametrize("name,targets", [("flex", ("qkv", "proj")), ("softmax", ALL_TARGETS)])
def test_merged_model_equals_unmerged(name: str, targets) -> None:
    config = ModelConfig(**CONFIGS[name])
    torch.manual_seed(0)
    plain = GPT(config)
    plain.final_norm.weight.requires_grad_(False)  # frozen before add_lora: must stay frozen after merge
    names_shapes = {k: v.shape for k, v in plain.state_dict().items()}
    ids, _ = _batch()
    with torch.no_grad():
        base = plain(ids).logits
    add_lora(plain, RANK, ALPHA, targets)
    _randomize_b(plain)
    with torch.no_grad():
        unmerged = plain(ids).logits
        assert (unmerged - base).abs().max() > 1e-3  # the adapters do change the model
        assert merge_lora(plain) == len(targets) * config.num_layers
        merged = plain(ids).logits
    # merging adds the rank-term product B A into each weight: the model's steps plus RANK
    steps = gpt_steps(config, ids.shape[-1]) + RANK + 2
    assert_close(merged, unmerged, steps=steps, name="merged")
    assert {k: v.shape for k, v in plain.state_dict().items()} == names_shapes
    assert not lora_parameters(plain) and not plain._forward_hooks
    assert [n for n, p in plain.named_parameters() if not p.requires_grad] == ["final_norm.weight"]
    # a plain GPT loads the merged weights strictly and computes the same logits
    fresh = GPT(config)
    load_state_dict_checked(fresh, plain.state_dict())
    with torch.no_grad():
        assert_close(fresh(ids).logits, unmerged, steps=steps, name="fresh")


@pytest.mark.parametrize("checkpointing", [False, True])
def test_training_steps_change_only_lora_parameters(checkpointing: bool) -> None:
    model = _lora_model("flex")
    model.set_activation_checkpointing(checkpointing)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(param_groups(model, weight_decay=0.0), lr=1e-2)
    ids, labels = _batch()
    for _ in range(2):  # step 1 moves B only (A's gradient is 0 while B = 0); step 2 moves A too
        optimizer.zero_grad(set_to_none=True)
        model(ids, labels=labels).loss.backward()
        optimizer.step()
    for n, p in model.named_parameters():
        if n.endswith((".lora.A", ".lora.B")):
            assert not torch.equal(p, before[n]), n
        else:
            assert p.grad is None and torch.equal(p, before[n]), n


def test_lora_layout_and_tp_init_are_slices_of_tp1() -> None:
    config = ModelConfig(**CONFIGS["softmax"])
    layout = _lora_layout(config, ALL_TARGETS)
    assert layout["blocks.0.attn.qkv.lora.A"] == ShardSpec(None)  # column-parallel: A replicated
    assert layout["blocks.0.attn.qkv.lora.B"] == ShardSpec(0)  # ... B split on out
    assert layout["blocks.0.attn.proj.lora.A"] == ShardSpec(1)  # row-parallel: A split on in
    assert layout["blocks.0.attn.proj.lora.B"] == ShardSpec(None)  # ... B replicated
    assert layout["blocks.1.mlp.fc_in.lora.B"] == ShardSpec(0) and layout["blocks.1.mlp.fc_out.lora.A"] == ShardSpec(1)
    assert {k: v for k, v in layout.items() if ".lora." not in k} == gpt_layout(config)
    full = _lora_model("softmax", ALL_TARGETS, seed=5).state_dict()
    expected = split_state_dict(full, layout, 2)
    for tp_rank in range(2):
        torch.manual_seed(5)
        shard = parallelize_gpt(GPT(config), ParallelState.detached(2, tp_rank), seed=0)
        add_lora(shard, RANK, ALPHA, ALL_TARGETS)
        for key, value in shard.state_dict().items():
            assert torch.equal(value, expected[tp_rank][key]), key


def test_bad_inputs_raise_clear_errors() -> None:
    torch.manual_seed(0)
    model = GPT(ModelConfig(**CONFIGS["flex"]))
    with pytest.raises(ValueError, match=r"rank: expected an integer >= 1, got 0"):
        add_lora(model, 0, ALPHA)
    with pytest.raises(ValueError, match=r"rank: expected an integer >= 1, got 2.5"):
        add_lora(model, 2.5, ALPHA)
    with pytest.raises(ValueError, match=r"rank: expected <= min\(in, out\) = 32 for a 32 -> 96 linear, got 33"):
        add_lora(model, 33, ALPHA)
    with pytest.raises(ValueError, match=r"alpha: expected a finite number > 0, got 0"):
        add_lora(model, RANK, 0)
    with pytest.raises(ValueError, match=r"targets: unknown \['q_proj'\]; known: \['fc_in', 'fc_out', 'proj', 'qkv'\]"):
        add_lora(model, RANK, ALPHA, ("qkv", "q_proj"))
    with pytest.raises(ValueError, match=r"targets: expected at least one of"):
        add_lora(model, RANK, ALPHA, ())
    with pytest.raises(ValueError, match=r"model: no Attention/MLP modules found"):
        add_lora(torch.nn.Linear(4, 4), RANK, ALPHA)
    with pytest.raises(ValueError, match=r"model: no LoRA adapters to merge"):
        merge_lora(model)
    # nothing above changed the model
    assert all(p.requires_grad for p in model.parameters()) and not lora_parameters(model)
    add_lora(model, RANK, ALPHA, "qkv")  # one target as a string
    with pytest.raises(ValueError, match=r"model: blocks\.0\.attn\.qkv already has a LoRA adapter; call merge_lora first"):
        add_lora(model, RANK, ALPHA)


# ----------------------------------------------------------------------------------------
# TP=2 (2 gloo ranks) and DeepSpeed ZeRO 0 / 2 under it
# ----------------------------------------------------------------------------------------
SGD_LR, SGD_DECAY = 0.5, 0.1


def _reference(name: str, targets) -> dict:
    """TP=1 LoRA model: outputs, LoRA gradients, merged weights and the weights after one SGD step."""
    model = _lora_model(name, targets)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    _randomize_b(model)
    with torch.no_grad():  # non-trivial constant-initialised biases and gains (frozen, still used)
        for pname, p in model.named_parameters():
            if pname.endswith(("bias", "out_gain", "norm.weight")):
                p.add_(0.1 * torch.randn_like(p))
    ids, labels = _batch()
    out = model(ids, labels=labels)
    out.loss.backward()
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    ref = {
        "name": name, "targets": targets, "ids": ids, "labels": labels, "initial": initial,
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "logits": model.gather_logits(out.logits).detach(), "loss": out.loss.detach(),
        "grads": {n: p.grad.clone() for n, p in lora.items()},
        "grad_norm": torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in lora.values()])).item(),
    }
    merged = copy.deepcopy(model)
    merge_lora(merged)
    ref["merged"] = {k: v.detach().clone() for k, v in merged.state_dict().items()}
    with torch.no_grad():
        ref["merged_logits"] = merged.gather_logits(merged(ids).logits)
    optimizer = torch.optim.SGD(param_groups(model, SGD_DECAY), lr=SGD_LR)
    optimizer.step()
    ref["stepped"] = {n: p.detach().clone() for n, p in lora.items()}
    return ref


def _tp_lora_model(ref: dict, state: ParallelState, layout: dict) -> GPT:
    torch.manual_seed(0)
    model = parallelize_gpt(GPT(ModelConfig(**CONFIGS[ref["name"]])), state, seed=3)
    add_lora(model, RANK, ALPHA, ref["targets"])
    load_state_dict_checked(model, split_state_dict(ref["state_dict"], layout, state.tp_size)[state.tp_rank])
    return model


def _tp_worker(rank: int, world: int, refs: list[dict]) -> list[dict]:
    import deepspeed
    from deepspeed.runtime.utils import clip_grad_norm_

    from megaflex.parallel import DeepSpeedMPU
    from megaflex.training.deepspeed_config import init_deepspeed_distributed

    init_deepspeed_distributed("gloo")  # adopts the existing process group
    state = ParallelState.create(tensor_parallel_size=world)
    results = []
    for ref in refs:
        config = ModelConfig(**CONFIGS[ref["name"]])
        layout = _lora_layout(config, ref["targets"])
        torch.manual_seed(0)  # the adapters' init is the slice of TP=1's
        fresh = parallelize_gpt(GPT(config), state, seed=3)
        add_lora(fresh, RANK, ALPHA, ref["targets"])
        initial = split_state_dict(ref["initial"], layout, world)[state.tp_rank]
        init_ok = all(torch.equal(v, initial[k]) for k, v in fresh.state_dict().items())

        model = _tp_lora_model(ref, state, layout)
        out = model(ref["ids"], labels=ref["labels"])
        out.loss.backward()
        res = {
            "init_ok": init_ok, "logits": model.gather_logits(out.logits).detach(), "loss": out.loss.detach(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad},
        }
        merge_lora(model)
        res["merged"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            res["merged_logits"] = model.gather_logits(model(ref["ids"]).logits)

        for zero_stage in (0, 2):  # one SGD step of a DeepSpeed engine on the LoRA model
            model = _tp_lora_model(ref, state, layout)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            optimizer = torch.optim.SGD(param_groups(model, SGD_DECAY), lr=SGD_LR)
            ds_config = {
                "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2,
                "gradient_clipping": 1e9, "zero_optimization": {"stage": zero_stage},
                "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
                "steps_per_print": 2**31 - 1,
            }
            engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                                   mpu=DeepSpeedMPU(state), dist_init_required=False)
            engine.backward(engine(ref["ids"], labels=ref["labels"]).loss)
            # ZeRO 0 fp32 leaves the norm to the caller: DeepSpeed's own TP-aware norm of the grads
            norm0 = clip_grad_norm_(lora_parameters(model), max_norm=1e9, mpu=engine.mpu) if zero_stage == 0 else None
            engine.step()
            after = dict(model.named_parameters())
            res[f"zero{zero_stage}"] = {
                "grad_norm": float(norm0 if zero_stage == 0 else engine.get_global_grad_norm()),
                "frozen_unchanged": all(torch.equal(after[n], v) for n, v in before.items() if ".lora." not in n),
                "stepped": {n: p.detach().clone() for n, p in after.items() if ".lora." in n},
            }
        results.append(res)
    return results


@pytest.mark.slow
@pytest.mark.numerics
def test_tp2_lora_equals_tp1_also_under_deepspeed_zero() -> None:
    refs = [_reference("flex", ("qkv", "proj")), _reference("softmax", ALL_TARGETS)]
    per_rank = run_distributed(_tp_worker, 2, args=(refs,))
    for i, ref in enumerate(refs):
        config = ModelConfig(**CONFIGS[ref["name"]])
        layout = _lora_layout(config, ref["targets"])
        lora_layout = {k: v for k, v in layout.items() if ".lora." in k}
        # error growth (tests/numerics.py): the model with its rank-RANK adapters, the TP all-reduces,
        # the loss's token and vocabulary sums; gradients also over every (batch, token) position
        seq = ref["ids"].shape[-1]
        steps = gpt_steps(config, seq) + RANK + 2 + config.vocab_size + seq
        grad_steps = gpt_steps(config, seq, backward=True) + 2 * (RANK + 2 + config.vocab_size + 4 * seq)
        terms = max(normwise_scale(g) for g in ref["grads"].values())
        for res in (r[i] for r in per_rank):
            assert res["init_ok"]
            assert_close(res["logits"], ref["logits"], steps=steps, name="logits")
            assert_close(res["loss"], ref["loss"], steps=steps, name="loss")
            assert_close(res["merged_logits"], ref["merged_logits"], steps=steps, name="merged logits")
        grads = merge_shards([r[i]["grads"] for r in per_rank], lora_layout)
        assert grads.keys() == ref["grads"].keys()
        for n, g in ref["grads"].items():
            assert g.abs().max() > 0, n
            assert_close(grads[n], g, steps=grad_steps, floor=terms, name=n)
        # merged TP shards are a normal TP=2 checkpoint of the TP=1 merged model: W + B A (RANK terms)
        merged = merge_shards([r[i]["merged"] for r in per_rank], gpt_layout(config))
        assert merged.keys() == ref["merged"].keys()
        for n, w in ref["merged"].items():
            assert_close(merged[n], w, steps=RANK + 2, name=n)
        # the gradient norm: each gradient within the bound above
        grad_norm_steps = norm_steps(grad_steps, list(ref["grads"].values()), ref["grad_norm"], floor=terms)
        for stage in ("zero0", "zero2"):
            for res in (r[i][stage] for r in per_rank):
                assert res["frozen_unchanged"], stage
                assert_close(torch.tensor(res["grad_norm"]), torch.tensor(ref["grad_norm"]), steps=grad_norm_steps,
                             name=f"{stage} grad norm")
            stepped = merge_shards([r[i][stage]["stepped"] for r in per_rank], lora_layout)
            for n, w in ref["stepped"].items():
                # one SGD step w - lr (g + wd w): lr times the gradients' difference (their bound above)
                # plus the rounding of the update, a few operations on |w|
                scale = normwise_scale(w, floor=SGD_LR * terms)
                assert_close(stepped[n], w, steps=SGD_LR * grad_steps * terms / scale + 4, name=f"{stage} {n}")
