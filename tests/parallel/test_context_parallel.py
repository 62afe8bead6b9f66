"""Context parallelism: the parallel grid, the CP attention against the single-rank chunked form,
and the GPT under CP (and TP x CP) against the single-rank GPT (gloo CPU ranks).

The CP runs get the same inputs and weights as the reference; each rank keeps its slice of the
sequence. Parameter gradients of the CP run are the sum over CP ranks of what each rank computes
(what the DP x CP reduction of the trainer does, up to its 1/(DP x CP) average and CP loss scale).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from megaflex.attention import AttentionCore
from megaflex.model.config import ModelConfig
from megaflex.model.gpt import GPT
from megaflex.parallel import (
    ContextParallelAttention,
    ParallelDims,
    ParallelState,
    TensorParallelLayers,
    parallelize_gpt,
    sequence_slice,
)
from megaflex.checkpoint.reshard import gpt_layout, load_state_dict_checked, merge_shards, split_state_dict
from attention_helpers import form_steps, saved_bytes
from numerics import assert_close, gpt_steps, normwise_scale
from test_parallel_model import CONFIGS, _reference


# ----------------------------------------------------------------------------------------
# single process: the grid
# ----------------------------------------------------------------------------------------
def test_dims_groups_tp_cp_dp() -> None:
    dims = ParallelDims(world_size=8, tp_size=2, cp_size=2)
    assert dims.dp_size == 2
    assert dims.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.cp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.dp_cp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]  # same parameter shard: ZeRO's group
    assert dims.mp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [dims.coords(r) for r in (0, 3, 6)] == [(0, 0, 0, 0), (0, 0, 1, 1), (0, 1, 1, 0)]
    for rank in range(8):
        assert dims.rank_of(*dims.coords(rank)) == rank


def test_dims_errors_name_the_sizes() -> None:
    with pytest.raises(ValueError, match=r"divisor of the world size 6, got 2 x 2 x 1 = 4"):
        ParallelDims(world_size=6, tp_size=2, cp_size=2)
    with pytest.raises(ValueError, match="cp_size: expected a positive int, got 0"):
        ParallelDims(world_size=2, cp_size=0)
    with pytest.raises(ValueError, match="ffn_hidden_size: expected a multiple of the tensor-parallel size 4, got 90"):
        ParallelDims.for_model(8, 4, 2, num_heads=8, ffn_hidden_size=90)
    assert ParallelDims.for_model(8, 2, 2, num_heads=4, ffn_hidden_size=64).dp_size == 2


def test_cp_refuses_softmax_and_decoding_states() -> None:
    state = ParallelState.single()
    with pytest.raises(ValueError, match="context_parallel_size: expected 1 for attention kind 'softmax'"):
        ContextParallelAttention(AttentionCore("softmax", 2, 8), state)
    attend = ContextParallelAttention(AttentionCore("elu", 2, 8, feature_dim=8), state)
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="decode .* with context_parallel_size=1"):
        attend(x, x, x, return_state=True)


def test_local_state_on_the_gpu_plan_maps_all_heads_at_once(monkeypatch) -> None:
    """CP's local state with the trig map's GPU plan (forced on CPU tensors): every key block is
    mapped for all (batch, head) rows in one call, no loop over them; the state and its gradients
    (k, v, Omega, tau) equal those of the plain-autograd reference map."""
    from megaflex.attention.feature_maps import trig as _trig
    from megaflex.parallel.context_parallel import local_state, mapped_local_state
    from attention_helpers import make_map, map_steps

    monkeypatch.setattr(_trig, "_per_head_items", lambda device: False)
    calls: list[int] = []
    trig_rows = _trig.trig_rows
    monkeypatch.setattr(_trig, "trig_rows", lambda xb, *args: (calls.append(xb.shape[0]), trig_rows(xb, *args))[1])
    batch, heads, n, d = 2, 3, 70, 8
    fmap = make_map("flexformer_n", heads, d, 12)
    g = torch.Generator().manual_seed(5)
    k = (torch.randn(batch, heads, n, d, generator=g) * 0.7).requires_grad_()
    v = torch.randn(batch, heads, n, d, generator=g).requires_grad_()
    s, m = mapped_local_state(fmap, k, v, 0)
    omega, inv_t, paired = fmap.trig_spec()
    ref_s, ref_m = local_state(*_trig.trig_feature_map_reference(k, omega, inv_t, paired=paired), v)
    assert calls == [batch * heads] * len(calls) and calls  # forward (and checkpoint recompute) calls
    steps = map_steps(k, omega) + 2 * n
    assert_close(s, ref_s, steps=steps, name="state")
    assert torch.equal(m, ref_m)
    leaves = [k, v, *fmap.parameters()]
    probe = torch.randn(ref_s.shape, generator=g)
    for got, want in zip(torch.autograd.grad((s * probe).sum(), leaves), torch.autograd.grad((ref_s * probe).sum(), leaves)):
        assert_close(got, want, steps=steps)


# ----------------------------------------------------------------------------------------
# multi process: the attention alone
# ----------------------------------------------------------------------------------------
# (kind, normalization, key scale, dtype): x10 keys make Flexformer-N's log-scale ||k||^2 / e^tau
# x100 (hundreds: without the stabiliser exp(kls) would overflow fp32). At that scale, and with
# the signed trig features' near-zero denominators, the problem is so ill-conditioned that the fp32
# single-rank form itself is 1e-5..1e-3 (relative) away from fp64 in some gradients, and CP in fp32
# lands as far on the other side. Those cases compare CP and single rank in fp64, where 1e-5 / 1e-4
# tests the maths (rescaling to the common max across ranks) rather than fp32 rounding.
ATTENTION_CASES = [
    ("flexformer_n", "rms", 1.0, torch.float32),
    ("flexformer_n", "denominator", 1.0, torch.float64),
    ("flexformer_n", "rms", 10.0, torch.float64),
    ("flexformer_n", "denominator", 10.0, torch.float64),
    ("flexformer_n", "capped_denominator", 1.0, torch.float64),
    ("cosformer", "denominator", 1.0, torch.float32),  # position-dependent map: global offsets
]


def _attention_run(
    kind: str, normalization: str, key_scale: float, n: int, chunk: int, state: ParallelState | None,
    dtype: torch.dtype = torch.float32, form: str = "chunked",
):
    """Outputs and gradients of one core on the whole sequence (state None) or this CP rank's slice."""
    torch.manual_seed(0)
    core = AttentionCore(kind, 2, 8, feature_dim=16, normalization=normalization, chunk_size=chunk, max_seq_len=n, form=form)
    core.to(dtype)
    gen = torch.Generator().manual_seed(1)
    q, k, v, weight = (torch.randn(2, 2, n, 8, generator=gen).to(dtype) for _ in range(4))
    k = k * key_scale
    if state is not None:
        q, k, v, weight = (sequence_slice(t, state.cp_rank, state.cp_size, dim=2) for t in (q, k, v, weight))
    # error growth (tests/numerics.py) on the whole sequence, plus the CP ranks' state combination;
    # parameters' gradients sum over every (batch, head, token) position
    steps = form_steps(core.feature_map, q, k, v) + 2 * (q[..., 0].numel() + (1 if state is None else state.cp_size))
    return {**outputs_and_grads(core, state, q, k, v, weight), "steps": steps}


def outputs_and_grads(core: AttentionCore, state: ParallelState | None, q, k, v, weight, **attend_kwargs) -> dict:
    """The core's output on (q, k, v) (this CP rank's slice under ``state``), and the gradients of
    (out * weight).sum() w.r.t. q, k, v and the core's parameters (summed over the CP ranks)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    attend = core if state is None else ContextParallelAttention(core, state)
    out, _ = attend(q, k, v, **attend_kwargs)
    (out * weight).sum().backward()
    params = {name: p.grad.clone() for name, p in core.named_parameters()}
    if state is not None:
        for g in params.values():
            dist.all_reduce(g, group=state.cp_group)
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad, "params": params}


def _assert_cp_equals_single_rank(
    got: dict, ref: dict, state: ParallelState, dtype: torch.dtype, case: object, plain: dict | None = None
) -> None:
    """This rank's slice of the outputs and input gradients, and the CP-summed parameter gradients,
    within the rounding bound of the single-rank run (gradients on the largest one's scale: an entry
    near 0 carries the rounding of its large terms). ``plain``: the single-rank quadratic form, whose
    difference from ``ref`` measures the conditioning (signed trig features under "denominator")."""
    steps = max(got["steps"], ref["steps"])

    def rank_slice(result: dict, name: str) -> torch.Tensor:
        return sequence_slice(result[name], state.cp_rank, state.cp_size, dim=2)

    wants = {name: rank_slice(ref, name) for name in ("out", "q", "k", "v")}
    terms = max(normwise_scale(g) for g in [*wants.values(), *ref["params"].values()][1:])
    for name in ("out", "q", "k", "v"):
        assert_close(got[name], wants[name], steps=steps, dtype=dtype, floor=0.0 if name == "out" else terms,
                     plain=None if plain is None else rank_slice(plain, name), name=f"{case} {name}")
    assert ref["params"].keys() == got["params"].keys()
    for name, want in ref["params"].items():
        assert_close(got["params"][name], want, steps=steps, dtype=dtype, floor=terms,
                     plain=None if plain is None else plain["params"][name], name=f"{case} {name}")


def _attention_worker(rank: int, world: int, n: int, chunk: int) -> list[str]:
    state = ParallelState.create(context_parallel_size=world)
    checked = []
    for case in ATTENTION_CASES:
        kind, normalization, key_scale, dtype = case
        ref = _attention_run(kind, normalization, key_scale, n, chunk, None, dtype)
        got = _attention_run(kind, normalization, key_scale, n, chunk, state, dtype)
        plain = _attention_run(kind, normalization, key_scale, n, chunk, None, dtype, form="quadratic")
        _assert_cp_equals_single_rank(got, ref, state, dtype, case, plain)
        checked.append(f"{case}: out q k v {sorted(ref['params'])}")
    return checked


@pytest.mark.slow
@pytest.mark.parametrize("cp,n,chunk", [(2, 74, 16), (4, 76, 8)])  # slices of 37 / 19 tokens: partial chunks
def test_attention_cp_equals_single_rank_chunked(cp: int, n: int, chunk: int) -> None:
    results = run_distributed(_attention_worker, cp, args=(n, chunk))
    assert all(len(r) == len(ATTENTION_CASES) for r in results)
    assert any("omega1" in line and "tau" in line for line in results[0])  # Omega1, Omega2, tau compared


def _long_slice_worker(rank: int, world: int, n: int) -> dict[str, float]:
    """Slices long enough for the fused CPU trig path, local state over several key blocks: CP equals
    the single-rank core, and keeps no more for backward than the core on the same slice."""
    import megaflex.parallel.context_parallel as cp_module

    cp_module._STATE_BLOCK_ELEMENTS = 1 << 12  # blocks of 256 rows: several per slice
    state = ParallelState.create(context_parallel_size=world)
    ref = _attention_run("flexformer_n", "rms", 1.0, n, 64, None)
    got = _attention_run("flexformer_n", "rms", 1.0, n, 64, state)
    # fp32 sums over 2 x 2 x 4200 token terms (counted in the steps)
    _assert_cp_equals_single_rank(got, ref, state, torch.float32, "long slices")
    core = AttentionCore("flexformer_n", 2, 8, feature_dim=16, chunk_size=64)
    q, k, v = (torch.randn(2, 2, n // world, 8, requires_grad=True) for _ in range(3))
    return {
        "core": saved_bytes(lambda: core(q, k, v)),
        "cp": saved_bytes(lambda: ContextParallelAttention(core, state)(q, k, v)),
        "features": 2 * 2 * (n // world) * 16 * 4,  # one [B, H, n, F] fp32 tensor
    }


@pytest.mark.slow
def test_attention_cp_long_slices_fused_path_and_memory() -> None:
    # 2 x 2100 tokens: one head per block in the chunked plan, i.e. the fused trig map + chunked form
    for saved in run_distributed(_long_slice_worker, 2, args=(4200,)):
        # the CP path keeps what the core keeps, plus O(1) states: not even one [B, H, n, F] tensor more
        assert saved["core"] <= saved["cp"] < saved["core"] + saved["features"] // 4, saved


# ----------------------------------------------------------------------------------------
# multi process: the GPT
# ----------------------------------------------------------------------------------------
SEQ = 24  # CP=2: slices of 12 tokens, chunk 8 (partial chunks)


def _gpt_worker(rank: int, world: int, tp: int, cp: int, refs: list[dict]) -> list[dict]:
    state = ParallelState.create(tensor_parallel_size=tp, context_parallel_size=cp)
    results = []
    for ref in refs:
        config = ModelConfig(**ref["config"])
        model = parallelize_gpt(GPT(config), state, seed=3)
        load_state_dict_checked(model, split_state_dict(ref["state_dict"], gpt_layout(config), tp)[state.tp_rank])
        ids, labels = (sequence_slice(t, state.cp_rank, state.cp_size) for t in (ref["ids"], ref["labels"]))
        out = model(ids, labels=labels)
        out.loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g, group=state.cp_group)
        results.append({
            "logits": model.gather_logits(out.logits).detach(), "loss": out.loss.detach(), "grads": grads,
            "tp_rank": state.tp_rank, "cp_rank": state.cp_rank,
        })
    return results


@pytest.mark.slow
@pytest.mark.parametrize("tp,cp", [(1, 2), (2, 2)])
def test_gpt_context_parallel_equals_single_rank(tp: int, cp: int) -> None:
    refs = [_reference(name, seq=SEQ) for name in ("flex_tied", "hedgehog_untied", "flex_window", "flex_window_remedies")]
    per_rank = run_distributed(_gpt_worker, tp * cp, args=(tp, cp, refs))
    for i, ref in enumerate(refs):
        n = SEQ // cp
        config = ModelConfig(**ref["config"])
        # the loss also sums over the tokens and the vocabulary (log-sum-exp); gradients also over
        # every (batch, token) position, all on the largest gradient's scale; the CP ranks' sums add cp
        steps = gpt_steps(config, SEQ) + SEQ + config.vocab_size + cp
        grad_steps = gpt_steps(config, SEQ, backward=True) + 2 * (ref["ids"].numel() + config.vocab_size + cp)
        terms = max(normwise_scale(g) for g in ref["grads"].values())
        for res in (r[i] for r in per_rank):
            assert_close(res["loss"], ref["loss"], steps=steps, name="loss")
            want = ref["logits"][:, res["cp_rank"] * n : (res["cp_rank"] + 1) * n]
            assert_close(res["logits"], want, steps=steps, name="logits")
        layout = gpt_layout(ModelConfig(**ref["config"]))
        shards = sorted((r[i] for r in per_rank if r[i]["cp_rank"] == 0), key=lambda r: r["tp_rank"])
        grads = merge_shards([s["grads"] for s in shards], {k: layout[k] for k in ref["grads"]})
        assert grads.keys() == ref["grads"].keys()
        for name, want in ref["grads"].items():
            assert_close(grads[name], want, steps=grad_steps, floor=terms, name=name)


def test_gpt_under_cp_refuses_softmax() -> None:
    config = ModelConfig(**CONFIGS["softmax"])
    model = parallelize_gpt(GPT(config), ParallelState(ParallelDims(2, cp_size=2), 1), seed=0)
    assert isinstance(model.layer_factory, TensorParallelLayers)  # CP alone parallelises the model too
    with pytest.raises(ValueError, match="context_parallel_size: expected 1 for attention kind 'softmax'"):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_config_errors_for_context_parallelism(tmp_path) -> None:
    from megaflex.training.config import ConfigError, load_config, validate_runtime
    from training_harness import write_config

    tiny = write_config(tmp_path / "tiny.yaml")  # seq_len 64, 4 heads, flexformer_n
    with pytest.raises(ConfigError, match=r"data.seq_len .*expected a multiple of parallel.context_parallel_size \(3\), got 64"):
        load_config([tiny], ["parallel.context_parallel_size=3"])
    with pytest.raises(ConfigError, match="parallel.context_parallel_size .*expected 1 for model.attention='softmax'"):
        load_config([tiny], ["parallel.context_parallel_size=2", "model.attention=softmax"])
    for closer in (["model.softmax_window=8", "model.window_mixing=gated"], ["model.qkv_conv_size=3"]):
        with pytest.raises(ConfigError, match="parallel.context_parallel_size .*need the previous rank's tokens"):
            load_config([tiny], ["parallel.context_parallel_size=2", *closer])
    load_config([tiny], ["parallel.context_parallel_size=2", "model.softmax_window=8"])  # the halo exchange
    with pytest.raises(ConfigError, match=r"slices of at least model.softmax_window - 1 = 39 tokens"):
        load_config([tiny], ["parallel.context_parallel_size=2", "model.softmax_window=40"])
    cfg = load_config([tiny], ["parallel.context_parallel_size=2", "parallel.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"divisor of the world size 6, got 2 x 2 x 1 = 4"):
        validate_runtime(cfg, world_size=6, has_cuda=False)
    validate_runtime(cfg, world_size=8, has_cuda=False)  # DP = 2


@pytest.mark.slow
def test_benchmark_points_agree_and_cp_bytes_do_not_depend_on_n() -> None:
    from benchmarks.context_parallel import bench_point

    model = dict(vocab_size=64, num_layers=1, hidden_size=16, num_heads=2, attention="flexformer_n", feature_dim=8, chunk_size=16)
    short, long = bench_point(model, 128, 2, 1), bench_point(model, 512, 2, 1)
    assert short["cp_bytes_per_layer"] == long["cp_bytes_per_layer"] > 0
    # forward state [kv | k_sum | log_max] + backward state gradient [kv | k_sum], fp32, B=1, H=2, F=d=8
    assert short["cp_bytes_per_layer"] == 2 * (8 * 9 + 1) * 4 + 2 * 8 * 9 * 4
    assert bench_point(model, 512, 1, 1)["loss"] == pytest.approx(long["loss"], abs=1e-5)
