"""Deferred initialisation (``megaflex.parallel.deferred_init``): a ZeRO-3 ``zero.Init`` build
equals the eager build parameter for parameter, and the 1.3B config builds under ZeRO-3 on two
CPU ranks with a peak RSS per rank below its fp32 size."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed

from megaflex.model import GPT, ModelConfig

VOCAB = 301  # padded to 384: the padding rows must match too
CONFIGS = {
    # Flexformer-N (learnable Omega, tau), tied embeddings, GELU, rms normalisation with out_gain
    "flex_tied": dict(vocab_size=VOCAB, num_layers=2, hidden_size=32, num_heads=4, attention="flexformer_n",
                      feature_dim=16, chunk_size=8, max_seq_len=64),
    # Hedgehog, untied head, SwiGLU, biases, learned positions
    "hedgehog_untied": dict(vocab_size=VOCAB, num_layers=2, hidden_size=32, num_heads=4, attention="hedgehog",
                            feature_dim=16, chunk_size=8, max_seq_len=64, tie_embeddings=False, mlp="swiglu",
                            bias=True, normalization="denominator", position="learned"),
}


def _zero3_config(dp: int) -> dict:
    return {"train_batch_size": dp, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def _compare_worker(rank: int, world: int, config: dict, tp: int) -> dict:
    """Eager and deferred builds of the same seed on this rank; the deferred one gathered."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    from megaflex.parallel import ParallelState, deepspeed_mpu, model_parallel_seed, parallel_layers, parallelize_with
    from megaflex.parallel.deferred_init import full_shape, is_partitioned, zero3_build
    from megaflex.training.deepspeed_config import init_deepspeed_distributed

    init_deepspeed_distributed("gloo")  # adopts the test's process group
    state = ParallelState.create(tensor_parallel_size=tp)
    mpu = deepspeed_mpu(state)
    model_config = ModelConfig(**config)

    def build() -> GPT:  # the trainer's order: seed, then the plain model
        model_parallel_seed(7, state.tp_rank)
        return GPT(model_config)

    layers = parallel_layers(state, seed=7)

    def parallelize(module):  # the eager model whole; the deferred one block by block, then the rest
        return module if layers is None else parallelize_with(module, layers, model_config)

    eager = parallelize(build())
    deferred = zero3_build(build, _zero3_config(dp=2 // tp), mpu, prepare=parallelize)
    out = {"partitioned": all(is_partitioned(p) for p in deferred.parameters()),
           "local_numel": sum(p.ds_tensor.numel() for p in deferred.parameters()),
           "shapes_match": all(tuple(full_shape(q)) == tuple(p.shape)
                               for p, q in zip(eager.parameters(), deferred.parameters())),
           "mismatch": []}
    eager_buffers = dict(eager.named_buffers())
    for (name, p), q in zip(eager.named_parameters(), deferred.parameters()):
        with GatheredParameters([q]):
            if q.shape != p.shape or not torch.equal(q.data, p.data):
                out["mismatch"].append(name)
    for name, buffer in deferred.named_buffers():
        if not torch.equal(buffer, eager_buffers[name]):
            out["mismatch"].append(name)
    out["eager_numel"] = sum(p.numel() for p in eager.parameters())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_deferred_init_equals_eager_build_dp2(name: str) -> None:
    """ZeRO-3 over 2 data-parallel ranks: every parameter (tied embedding, padding rows, Omega,
    tau, gains, biases) and buffer equals the eager build's, and each rank holds half."""
    for result in run_distributed(_compare_worker, 2, args=(CONFIGS[name], 1)):
        assert result["partitioned"] and result["shapes_match"]
        assert result["mismatch"] == []
        # ZeRO-3 pads each parameter to a multiple of the group size: at most one element each
        assert result["eager_numel"] / 2 <= result["local_numel"] <= result["eager_numel"] / 2 + 100


@pytest.mark.slow
def test_deferred_init_equals_eager_build_tp2() -> None:
    """Under TP=2 each plain block is parallelised (whole matrices sliced, the core's heads copied
    from the whole core) before it is partitioned, so the deferred TP shards equal the eager ones."""
    for result in run_distributed(_compare_worker, 2, args=(CONFIGS["flex_tied"], 2)):
        assert result["partitioned"] and result["shapes_match"]
        assert result["mismatch"] == []


def _train_losses(run_dir) -> list[float]:
    """The loss of each step in order (its latest record)."""
    from megaflex.training.metrics import read_metrics

    records = read_metrics(run_dir / "metrics.jsonl")
    return [records[step]["loss"] for step in sorted(records)]


@pytest.mark.slow
def test_trainer_zero3_deferred_init_trains_and_warm_starts_like_eager(tmp_path) -> None:
    """The trainer under ZeRO-3 on 2 ranks: deferred init (auto) logs the eager build's losses
    step for step, a warm start (checkpoint.init_from) into a deferred model equals one into an
    eager model, and a deferred run killed after its step-3 checkpoint resumes onto the eager
    run's uninterrupted curve."""
    from training_harness import TINY, launch, write_config

    cfg = write_config(tmp_path / "tiny.yaml", dict(TINY, train=dict(TINY["train"], train_iters=4, eval_iters=1),
                                                     checkpoint={"save_interval": 3}))
    common = ["parallel.zero_stage=3"]
    warm = ["train.train_iters=3", "checkpoint.save_interval=0", "checkpoint.save_at_end=false"]
    runs = {  # name: overrides, the ranks' exit status
        "eager": (["parallel.deferred_init=false"], 0),
        "deferred": (["fault.sigkill_after_step=3"], -9),  # after its step-3 checkpoint
        "warm_eager": (["parallel.deferred_init=false", f"checkpoint.init_from={tmp_path / 'eager'}", *warm], 0),
        "warm_deferred": ([f"checkpoint.init_from={tmp_path / 'eager'}", *warm], 0),
    }
    losses = {}
    for name, (overrides, status) in runs.items():
        result = launch(cfg, common + overrides + [f"logging.run_dir={tmp_path / name}"], 2)
        assert result.returncodes == [status, status], result.output
        deferred = "parallel.deferred_init=false" not in overrides
        assert ("deferred init: the model was built partitioned over 2" in result.outputs[0]) == deferred
        losses[name] = _train_losses(tmp_path / name)
    assert len(losses["eager"]) == 4 and losses["deferred"] == losses["eager"][:3]
    assert len(losses["warm_eager"]) == 3 and losses["warm_deferred"] == losses["warm_eager"]
    assert losses["warm_eager"][0] < losses["eager"][0]  # the warm start did copy the trained weights
    # resuming the deferred run's checkpoint (step 3) continues as the eager run did
    result = launch(cfg, common + [f"logging.run_dir={tmp_path / 'deferred'}"], 2)
    assert result.returncodes == [0, 0] and "resumed from" in result.outputs[0], result.output
    assert "deferred init: the model was built partitioned over 2" in result.outputs[0]
    assert _train_losses(tmp_path / "deferred") == losses["eager"]


def _rss_worker(rank: int, world: int, config_path: str) -> dict:
    """Build the config's model as the trainer does (ZeRO-3, deferred) and report peak RSS."""
    from megaflex.parallel import ParallelState, model_parallel_seed
    from megaflex.parallel.deferred_init import full_numel
    from megaflex.training.build import build_gpt
    from megaflex.training.config import load_config
    from megaflex.training.deepspeed_config import init_deepspeed_distributed
    from megaflex.training.metrics import peak_rss_kib

    init_deepspeed_distributed("gloo")
    cfg = load_config([config_path], ["parallel.zero_stage=3", "train.device=cpu", "data.source=synthetic"])
    state = ParallelState.create(tensor_parallel_size=1)
    before = peak_rss_kib() * 1024  # this process's own peak (not the pytest worker's, see peak_rss_kib)
    model_parallel_seed(cfg.train.seed, 0)
    model = build_gpt(cfg, state, "cpu")
    peak = peak_rss_kib() * 1024
    return {"before": before, "peak": peak, "params": sum(full_numel(p) for p in model.parameters()),
            "local_bytes": sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters()),
            "dtype": str(next(model.parameters()).dtype)}


@pytest.mark.slow
def test_1_3b_zero3_build_peak_rss_per_rank_below_the_fp32_model(tmp_path) -> None:
    """configs/flexformer_n_1.3b.yaml (bf16) under ZeRO-3 on 2 CPU ranks, build only."""
    from training_harness import REPO

    results = run_distributed(_rss_worker, 2, args=(str(REPO / "configs" / "flexformer_n_1.3b.yaml"),), timeout=900)
    fp32_bytes = 4 * results[0]["params"]  # 5.14 GB: what an eager build holds on every rank, before its bf16 cast
    for r in results:
        assert r["dtype"] == "torch.bfloat16" and r["local_bytes"] <= fp32_bytes / 4 + 2**20  # bf16, half each
        # Bound: the fp32 model size, as the issue asks. An eager build holds the whole fp32 model
        # (5.14 GB) plus the interpreter on every rank before its bf16 cast, so it cannot pass;
        # the deferred build holds its bf16 shard (1.29 GB) plus transients (the fp32 embedding
        # until the build ends, one fp32 block and its bf16 copy while it is partitioned).
        # Measured (2 gloo ranks, this 2-core CPU): 2.0 GB run alone, 3.2 GB inside the full
        # parallel CI run (allocator reuse differs under load), i.e. 0.40-0.62 x the fp32 size.
        assert r["peak"] < fp32_bytes, (r, fp32_bytes)
