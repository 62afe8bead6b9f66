"""Tensor-parallel building blocks vs. their single-device equivalents.

Single-process tests cover the rank arithmetic, the cross-entropy maths at TP=1 and the RNG
tracker; multi-process (gloo) tests check that every sharded computation equals the
unsharded one, forward and backward, at TP=2 and TP=4.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed import run_distributed
from megaflex.model.layers import linear, normal_init, pad_vocab_size, vocab_embedding
from megaflex.parallel import (
    ColumnParallelLinear,
    DeepSpeedMPU,
    ParallelDims,
    ParallelState,
    RowParallelLinear,
    TensorParallelLayers,
    TensorParallelRNGTracker,
    VocabParallelEmbedding,
    copy_to_tp_region,
    gather_from_tp_region,
    initialize_parallel_state,
    model_parallel_seed,
    reduce_from_tp_region,
    scatter_to_tp_region,
    vocab_parallel_cross_entropy,
)
from numerics import assert_close, fp32_steps_in

pytestmark = pytest.mark.numerics



def cross_entropy_steps(logits: torch.Tensor, vocab: int, tp: int = 1) -> float:
    """Error growth (tests/numerics.py) of cross-entropy and its gradient: the vocab-term sum of
    exps (all-reduced over tp ranks), exp arguments logit - max up to twice max |logit|, a log, the
    smoothing mean and a division."""
    return vocab + tp + 2 * logits[..., :vocab].detach().float().abs().max().item() + 8


# ----------------------------------------------------------------------------------------
# single process
# ----------------------------------------------------------------------------------------
def test_layout_megatron_order() -> None:
    layout = ParallelDims(world_size=8, tp_size=2, pp_size=2)
    assert layout.dp_size == 2
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.mp_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    for rank in range(8):
        assert layout.rank_of(*layout.coords(rank)) == rank
    # every rank is in exactly one group of each kind
    for groups in (layout.tp_groups(), layout.dp_groups(), layout.pp_groups(), layout.mp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(8))


def test_layout_rejects_tp_not_dividing_world() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size.*world size 4.*got 3"):
        ParallelDims(world_size=4, tp_size=3)
    with pytest.raises(ValueError, match="tp_size"):
        ParallelDims(world_size=4, tp_size=0)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_tp1_matches_torch(smoothing: float) -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 37
    logits = torch.randn(3, 5, pad_vocab_size(vocab, 1), generator=gen) * 3
    logits[..., vocab:] = 100.0  # padding must be ignored however large
    labels = torch.randint(0, vocab, (3, 5), generator=gen)
    labels[0, 1] = -100
    upstream = torch.rand(3, 5, generator=gen)

    ref_logits = logits[..., :vocab].clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits.reshape(-1, vocab), labels.reshape(-1), reduction="none", label_smoothing=smoothing)
    (ref * upstream.reshape(-1)).sum().backward()

    ours_logits = logits.clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(ours_logits, labels, vocab, ParallelState.single(), label_smoothing=smoothing)
    (loss * upstream).sum().backward()

    assert loss.dtype == torch.float32 and loss.shape == labels.shape
    steps = cross_entropy_steps(logits, vocab)
    assert_close(loss.reshape(-1), ref, steps=steps, name="loss")
    assert_close(ours_logits.grad[..., :vocab], ref_logits.grad, steps=steps, name="grad")
    assert torch.all(ours_logits.grad[..., vocab:] == 0)
    assert loss[0, 1] == 0 and torch.all(ours_logits.grad[0, 1] == 0)


def test_cross_entropy_bad_input() -> None:
    state = ParallelState.single()
    logits = torch.randn(2, 4, 128)
    with pytest.raises(ValueError, match=r"labels: expected shape \(2, 4\).*got \(2, 3\)"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 3, dtype=torch.long), 10, state)
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 4, dtype=torch.long), 200, state)
    with pytest.raises(ValueError, match="label_smoothing"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 4, dtype=torch.long), 10, state, label_smoothing=1.0)


def test_rng_tracker_fork_and_restore() -> None:
    trackers = [model_parallel_seed(42, tp_rank) for tp_rank in range(2)]
    x = torch.ones(1000)
    masks_in, masks_out = [], []
    for tracker in trackers:
        torch.manual_seed(42)  # what model_parallel_seed does on each rank
        with tracker.fork():
            masks_in.append(F.dropout(x, 0.5) != 0)
        masks_out.append(F.dropout(x, 0.5) != 0)
    assert not torch.equal(masks_in[0], masks_in[1]), "TP ranks must drop different units inside TP regions"
    assert torch.equal(masks_out[0], masks_out[1]), "the default RNG must stay identical across TP ranks"

    # The fork does not advance the default stream.
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    with trackers[0].fork():
        torch.rand(100)
    torch.testing.assert_close(torch.rand(4), expected, rtol=0, atol=0)

    # get_states/set_states reproduce the model-parallel stream.
    saved = trackers[0].get_states()
    with trackers[0].fork():
        first = torch.rand(8)
    with trackers[0].fork():
        second = torch.rand(8)
    assert not torch.equal(first, second)
    trackers[0].set_states(saved)
    with trackers[0].fork():
        assert torch.equal(torch.rand(8), first)

    fresh = TensorParallelRNGTracker()
    with pytest.raises(ValueError, match="unknown RNG stream"):
        with fresh.fork():
            pass
    fresh.add("a", 1)
    with pytest.raises(ValueError, match="seed"):
        fresh.add("b", 1)


def test_rng_tracker_replays_tp_dropout_under_activation_checkpointing() -> None:
    from torch.utils.checkpoint import checkpoint

    tracker = model_parallel_seed(3, tp_rank=1)
    weight = torch.randn(16, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        with tracker.fork():
            h = F.dropout(x @ weight, 0.5)  # a TP-region dropout: its mask comes from the tracker
        return F.dropout(torch.tanh(h), 0.3)  # default-RNG dropout

    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    saved_default, saved_tracker = torch.get_rng_state(), tracker.get_states()
    block(x).sum().backward()
    expected = weight.grad.clone()

    weight.grad = None
    torch.set_rng_state(saved_default)
    tracker.set_states(saved_tracker)
    out = checkpoint(block, x, use_reentrant=False, context_fn=tracker.checkpoint_context)
    after_forward = tracker.get_states()
    out.sum().backward()  # recompute: must replay both streams
    torch.testing.assert_close(weight.grad, expected, rtol=0, atol=0)
    for name, state in tracker.get_states().items():  # the replay did not rewind the stream
        assert torch.equal(state, after_forward[name])

    weight.grad = None
    torch.set_rng_state(saved_default)
    tracker.set_states(saved_tracker)
    checkpoint(block, x, use_reentrant=False).sum().backward()  # without the context: different masks
    assert not torch.equal(weight.grad, expected)


def test_bad_sizes_name_the_argument() -> None:
    state = ParallelState.detached(tp_size=4, tp_rank=1)
    with pytest.raises(ValueError, match="out_features: expected a multiple of the tensor-parallel size 4, got 6"):
        ColumnParallelLinear(linear(8, 6, bias=False, init_method=normal_init(0.02)), state)
    with pytest.raises(ValueError, match="in_features: expected a multiple of the tensor-parallel size 4, got 10"):
        RowParallelLinear(linear(10, 8, bias=False, init_method=normal_init(0.02)), state)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_parallel_layers_keep_this_ranks_slice_of_a_plain_layer(tp_rank: int) -> None:
    """Each TP layer is cut from a built plain layer (what ``parallelize_gpt`` does)."""
    state, init = ParallelState.detached(tp_size=2, tp_rank=tp_rank), normal_init(0.5)
    torch.manual_seed(3)
    plain_col = linear(8, 12, bias=True, init_method=init)
    plain_row = linear(12, 8, bias=True, init_method=init)
    plain_emb = vocab_embedding(300, 8, init_method=init)
    with torch.no_grad():
        plain_col.bias.normal_(), plain_row.bias.normal_()  # non-zero biases: their slicing is visible
    plain_row.weight.requires_grad_(False)  # a frozen weight stays frozen
    col = ColumnParallelLinear(plain_col, state)
    row = RowParallelLinear(plain_row, state)
    emb = VocabParallelEmbedding(plain_emb, state)
    assert torch.equal(col.weight, plain_col.weight.chunk(2)[tp_rank])
    assert torch.equal(col.bias, plain_col.bias.chunk(2)[tp_rank])
    assert torch.equal(row.weight, plain_row.weight.chunk(2, dim=1)[tp_rank]) and torch.equal(row.bias, plain_row.bias)
    assert not row.weight.requires_grad and col.weight.requires_grad
    table = torch.zeros(pad_vocab_size(300, 2), 8)  # 512 rows: the plain 384 and zero TP padding
    table[:384] = plain_emb.weight.detach()
    assert torch.equal(emb.weight, table.chunk(2)[tp_rank]) and emb.weight.true_vocab_size == 300
    assert (col.weight.partition_dim, col.bias.partition_dim, row.weight.partition_dim) == (0, 0, 1)
    assert not getattr(row.bias, "tensor_model_parallel", False)  # replicated


def test_detached_state_shapes_and_tags() -> None:
    state = ParallelState.detached(tp_size=2, tp_rank=1)
    col = ColumnParallelLinear(linear(8, 12, bias=True, init_method=normal_init(0.02)), state)
    row = RowParallelLinear(linear(12, 8, bias=True, init_method=normal_init(0.02)), state)
    emb = VocabParallelEmbedding(vocab_embedding(300, 8, init_method=normal_init(0.02)), state)
    assert col.weight.shape == (6, 8) and col.weight.partition_dim == 0 and col.bias.partition_dim == 0
    assert row.weight.shape == (8, 6) and row.weight.partition_dim == 1
    assert not getattr(row.bias, "tensor_model_parallel", False)  # replicated
    assert emb.weight.shape == (pad_vocab_size(300, 2) // 2, 8) and emb.weight.true_vocab_size == 300
    with pytest.raises(RuntimeError, match="no process groups"):
        row(torch.randn(2, 6))  # the forward all-reduce needs a group


# ----------------------------------------------------------------------------------------
# multi process
# ----------------------------------------------------------------------------------------
def _ce_worker(rank: int, world: int) -> None:
    # TP=2 (x DP=2, vocab 301) and TP=4 (vocab 300: shard 3 is all padding) in one world of 4.
    for tp, vocab in ((2, 301), (4, 300)):
        _check_ce(ParallelState.create(tensor_parallel_size=tp), vocab)


def _check_ce(state: ParallelState, vocab: int) -> None:
    rank = state.tp_rank
    padded = pad_vocab_size(vocab, state.tp_size)
    local = padded // state.tp_size
    for smoothing in (0.0, 0.2):
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator().manual_seed(1)  # identical full problem on every rank
            full = (torch.randn(4, 7, padded, generator=gen) * 4).to(dtype)
            full[..., vocab:] = 50.0  # padding is huge: any leak would dominate the loss
            labels = torch.randint(0, vocab, (4, 7), generator=gen)
            labels[1, 2] = -100
            labels[2, 3] = vocab - 1  # the last real id, on the last non-empty shard
            upstream = torch.rand(4, 7, generator=gen)

            ref_logits = full[..., :vocab].float().clone().requires_grad_(True)
            ref = F.cross_entropy(ref_logits.reshape(-1, vocab), labels.reshape(-1), reduction="none",
                                  label_smoothing=smoothing).view(4, 7)
            (ref * upstream).sum().backward()

            shard = full[..., rank * local:(rank + 1) * local].clone().requires_grad_(True)
            loss = vocab_parallel_cross_entropy(shard, labels, vocab, state, label_smoothing=smoothing)
            (loss * upstream).sum().backward()

            assert shard.grad.dtype == dtype
            steps = cross_entropy_steps(full, vocab, state.tp_size)
            assert_close(loss, ref, steps=steps, name=f"loss {dtype}")  # computed in fp32 from the same values
            ref_grad = torch.zeros(4, 7, padded)
            ref_grad[..., :vocab] = ref_logits.grad
            # bf16 gradients round once more (1 u_bf16) after the fp32 maths
            grad_steps = steps if dtype == torch.float32 else 1 + fp32_steps_in(dtype, steps)
            # entries ~0 (unlikely tokens) carry the rounding of the softmax's O(1) terms: floor 1
            assert_close(shard.grad.float(), ref_grad[..., rank * local:(rank + 1) * local], steps=grad_steps,
                         dtype=dtype, floor=1.0, name=f"grad {dtype}")


@pytest.mark.slow
def test_vocab_parallel_cross_entropy_matches_torch_tp2_tp4() -> None:
    run_distributed(_ce_worker, 4)


def _mappings_and_layers_worker(rank: int, world: int) -> dict:
    tp = 2
    state = ParallelState.create(tensor_parallel_size=tp)
    assert state.tp_ranks == [rank - rank % tp + i for i in range(tp)]
    assert state.dp_ranks == [state.tp_rank + i * tp for i in range(world // tp)]
    mpu = DeepSpeedMPU(state)
    assert mpu.get_tensor_model_parallel_world_size() == tp and mpu.get_data_parallel_world_size() == world // tp
    assert mpu.get_model_parallel_rank() == state.tp_rank and mpu.get_data_parallel_rank() == rank // tp
    probe = torch.tensor([float(rank)])
    dist.all_reduce(probe, group=mpu.get_data_parallel_group())
    assert probe.item() == sum(state.dp_ranks)
    r, coef = state.tp_rank, float(state.tp_rank + 1)
    sum_coef = tp * (tp + 1) / 2

    # --- the four mappings, forward and backward ----------------------------------------
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    (copy_to_tp_region(x, state) * coef).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, sum_coef))  # bwd all-reduce

    x.grad = None
    y = reduce_from_tp_region(x * coef, state)
    torch.testing.assert_close(y, x.detach() * sum_coef)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, coef))  # bwd identity

    x.grad = None
    y = scatter_to_tp_region(x, state)
    torch.testing.assert_close(y, x.detach()[:, r * 2:(r + 1) * 2])
    (y * coef).sum().backward()
    # bwd all-gathers every rank's grad: block i of x.grad is rank i's upstream grad (i + 1).
    expected = torch.cat([torch.full((3, 2), i + 1.0) for i in range(tp)], dim=-1)
    torch.testing.assert_close(x.grad, expected)

    mine = torch.full((3, 2), coef, requires_grad=True)
    y = gather_from_tp_region(mine, state)
    torch.testing.assert_close(y, torch.cat([torch.full((3, 2), i + 1.0) for i in range(tp)], dim=-1))
    weights = torch.arange(12.0).view(3, 4)
    (y * weights).sum().backward()
    torch.testing.assert_close(mine.grad, weights[:, r * 2:(r + 1) * 2])  # bwd split

    # --- layers: TP shards == slices of the TP=1 init, forward and grads equal -----------
    torch.manual_seed(123)
    init = normal_init(0.5)
    ref_mods = (
        vocab_embedding(200, 8, init_method=init),
        linear(8, 12, bias=True, init_method=init),
        linear(12, 8, bias=True, init_method=init),
    )
    tp_mods = (
        VocabParallelEmbedding(ref_mods[0], state),
        ColumnParallelLinear(ref_mods[1], state),
        RowParallelLinear(ref_mods[2], state),
    )
    for ref_mod in ref_mods[1:]:
        torch.nn.init.normal_(ref_mod.bias)  # non-zero biases so their handling is tested
    for ref_mod, tp_mod in zip(ref_mods[1:], tp_mods[1:]):
        dim = tp_mod.bias.partition_dim if getattr(tp_mod.bias, "tensor_model_parallel", False) else None
        tp_mod.bias.data.copy_(ref_mod.bias.data if dim is None else ref_mod.bias.data.chunk(tp)[r])

    emb_ref, col_ref, row_ref = ref_mods
    emb, col, row = tp_mods
    torch.testing.assert_close(col.weight, col_ref.weight.chunk(tp, 0)[r], rtol=0, atol=0)
    torch.testing.assert_close(row.weight, row_ref.weight.chunk(tp, 1)[r], rtol=0, atol=0)
    v_local = emb.weight.shape[0]
    ref_table = torch.zeros(pad_vocab_size(200, tp), 8)
    ref_table[: emb_ref.weight.shape[0]] = emb_ref.weight.detach()
    torch.testing.assert_close(emb.weight, ref_table[r * v_local:(r + 1) * v_local], rtol=0, atol=0)

    ids = torch.tensor([[0, 127, 128, 199, 5], [130, 1, 198, 64, 129]])  # both sides of the shard border
    upstream = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3))

    def mlp(e, c, w):
        return w(F.gelu(c(e(ids))))  # [2, 5, 8]

    out_ref = mlp(emb_ref, col_ref, row_ref)
    (out_ref * upstream).sum().backward()
    out = mlp(emb, col, row)
    (out * upstream).sum().backward()
    # 8- and 12-term products, the gelu, the TP all-reduce; gradients also sum over the 10 positions
    steps = 2 * (8 + 12 + tp + 4) + 2 * ids.numel()
    assert_close(out, out_ref, steps=steps, name="out")
    assert_close(col.weight.grad, col_ref.weight.grad.chunk(tp, 0)[r], steps=steps, name="col.weight")
    assert_close(col.bias.grad, col_ref.bias.grad.chunk(tp, 0)[r], steps=steps, name="col.bias")
    assert_close(row.weight.grad, row_ref.weight.grad.chunk(tp, 1)[r], steps=steps, name="row.weight")
    assert_close(row.bias.grad, row_ref.bias.grad, steps=steps, name="row.bias")
    ref_emb_grad = torch.zeros(pad_vocab_size(200, tp), 8)
    ref_emb_grad[: emb_ref.weight.shape[0]] = emb_ref.weight.grad
    assert_close(emb.weight.grad, ref_emb_grad[r * v_local:(r + 1) * v_local], steps=steps, name="embedding")

    # lm_logits + gather_logits == full logits; tp_region_rng differs per TP rank.
    tp_layers = TensorParallelLayers(state, seed=5)
    hidden = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(4))
    logits = tp_layers.gather_logits(tp_layers.lm_logits(hidden, emb.weight), 200)
    assert_close(logits, F.linear(hidden, emb_ref.weight)[..., :200], steps=8, name="logits")  # 8-term dots
    with tp_layers.tp_region_rng():
        inside = F.dropout(torch.ones(256), 0.5) != 0
    outside = F.dropout(torch.ones(256), 0.5) != 0
    return {"tp_rank": state.tp_rank, "inside": inside, "outside": outside}


@pytest.mark.slow
def test_mappings_layers_and_rng_at_tp2_dp2() -> None:
    results = run_distributed(_mappings_and_layers_worker, 4)
    for res in results:
        assert torch.equal(res["outside"], results[0]["outside"]), "default RNG must match on all ranks"
    assert not torch.equal(results[0]["inside"], results[1]["inside"]), "TP ranks must differ inside TP regions"
    assert torch.equal(results[0]["inside"], results[2]["inside"]), "same TP rank, other replica: same stream"


def _bad_tp_worker(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size.*expected a divisor of the world size 2, got 3"):
        initialize_parallel_state(tensor_parallel_size=3, backend="gloo")
    state = initialize_parallel_state(tensor_parallel_size=2)  # already initialised: reuses the world
    assert (state.tp_size, state.dp_size, state.tp_rank) == (2, 1, rank)


@pytest.mark.slow
def test_initialize_parallel_state_validates_tp() -> None:
    run_distributed(_bad_tp_worker, 2, init_process_group=False)
