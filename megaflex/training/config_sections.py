"""The sections of a run configuration: one typed dataclass per YAML section (``Config`` holds them
all), and the range of every float key. Loading, validation and the reference live in
``megaflex.training.config`` (which re-exports these); the checks (``config_checks``) read them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from megaflex.checkpoint.layout import CHECKPOINTS_DIR, run_checkpoint_dir
from megaflex.config_field import opt
from megaflex.model.config import ModelConfig
from megaflex.model.cross_entropy import DEFAULT_LOSS_CHUNK_TOKENS
from megaflex.parallel.config import ParallelConfig
from megaflex.training.config_loader import Range, to_dict


@dataclass
class DataConfig:
    """Where the tokens come from."""

    source: Literal["indexed", "synthetic"] = opt(
        "indexed", "`indexed`: Megatron .bin/.idx files (data_prep.preprocess); `synthetic`: seeded random tokens (benchmarks)"
    )
    train_path: list[str] = opt([], "prefixes of the training .bin/.idx pairs (path without extension)")
    train_weights: list[float] | None = opt(None, "blend weights of `train_path` (default: proportional to size)")
    valid_path: list[str] = opt([], "prefixes of the validation .bin/.idx pairs (empty: cut from train_path by `split`)")
    split: str = opt("969,30,1", "train,valid,test weights of the document split of train_path when valid_path is empty")
    tokenizer: str | None = opt(
        None, "tokenizer of the data (sentencepiece .model or tokenizer.json): must exist, match the data cards and "
        "fit model.vocab_size; "
        "its sha256 and vocab size are recorded with checkpoints and checked by evaluation"
    )
    seq_len: int = opt(1024, "tokens per training sample (<= model.max_seq_len)")
    cache_dir: str | None = opt(
        None, "where sample-index caches go (default: `index_cache/` next to the first train_path prefix; "
        "`<logging.run_dir>/index_cache` when that folder is not writable)"
    )
    document_boundaries: Literal["none", "reset"] = opt(
        "none", "`reset`: no attention across an EOD token in packed samples (linear state restarts at each "
        "document, softmax is block-causal); `none`: tokens attend across documents"
    )
    reset_positions: bool = opt(False, "with document_boundaries=reset: RoPE / learned positions restart at 0 in each document")
    eod_token_id: int | None = opt(None, "the EOD id document_boundaries=reset cuts after (default: data.tokenizer's)")


@dataclass
class OptimizerConfig:
    """AdamW (torch-native, fused where the device supports it)."""

    beta1: float = opt(0.9, "Adam beta1")
    beta2: float = opt(0.95, "Adam beta2")
    eps: float = opt(1e-8, "Adam epsilon")
    weight_decay: float = opt(0.1, "decoupled weight decay of matrices (see no_decay_patterns)")
    no_decay_patterns: list[str] = opt(
        [],
        "parameter-name substrings exempt from weight decay, besides every parameter with < 2 dims "
        "(biases, norm gains) and every learnable kernel parameter (Omega, tau, hedgehog's W: declared by "
        "the feature maps, never decayed: decay would pull the kernel to a flat one, not regularise capacity)",
    )
    kernel_frequency_lr_multiplier: float = opt(
        10.0,
        "LR of the kernel frequencies (Omega; role 'frequencies') = this x the scheduled LR (0 freezes them). "
        "Under Adam this equals learning Omega = s * Omega_hat with s = this multiplier",
    )
    kernel_temperature_lr_multiplier: float = opt(
        10.0,
        "LR of the kernel temperature (Flexformer-N's tau; role 'temperature', also the per-head scalars declared "
        "so: the gated window's mix, the window's far_log_gain, the q/k norm's log_gain) = this x the scheduled LR. "
        "Default 10 for both (single-seed pilot, docs/results/kernel_pilot: 10 beat 1 on both eval sets with both inits; "
        "30 was much worse). tau has no weight decay and drifts up over long schedules (toward a flatter kernel): "
        "model.feature_kwargs.max_log_temperature bounds it; study v5 tries 1 and 3 (issue 46)",
    )
    freeze_kernel: bool = opt(
        False,
        "freeze every learnable kernel parameter the feature maps declare (Omega, tau, hedgehog's W, the q/k/v "
        "convolution taps): requires_grad off, in no param group. For kernels that must stay as loaded or drawn "
        "(kernel transfer with checkpoint.init_parameters=kernel, random-kernel baselines); any kind, unlike the "
        "LR multipliers, which cover only Omega and tau",
    )
    fused: Literal["auto", "on", "off"] = opt("auto", "torch fused AdamW kernel (auto: on when the device supports it)")
    use_apex: bool = opt(False, "use apex FusedAdam instead (GPU; apex must be installed)")


DecayShape = Literal["cosine", "linear", "1-sqrt"]


@dataclass
class ScheduleConfig:
    """Learning-rate schedule: linear warmup, then decay to min_lr."""

    warmup_iters: int = opt(0, "iterations of linear warmup from 0 to train.lr")
    decay_style: Literal["cosine", "linear", "constant", "wsd"] = opt(
        "cosine", "shape of the decay after warmup; `wsd` (warmup-stable-decay): train.lr until the last "
        "`wsd_decay_fraction` of the decay iterations, then `wsd_decay_shape` down to min_lr",
    )
    decay_iters: int | None = opt(None, "iteration at which the decay reaches min_lr (default train.train_iters)")
    min_lr: float = opt(0.0, "learning rate at and after decay_iters")
    wsd_decay_fraction: float = opt(
        0.2, "decay_style wsd: share of the decay iterations (decay_iters, default train.train_iters) spent decaying, at their end"
    )
    wsd_decay_shape: DecayShape = opt(
        "1-sqrt", "decay_style wsd: `1-sqrt` (lr factor 1 - sqrt(progress), Hagele et al. 2024), `linear` or `cosine`"
    )

    def decay_window(self, train_iters: int) -> tuple[int, int]:
        """(first, end) iterations of the decay: the LR falls from train.lr at ``first`` to min_lr at ``end``."""
        end = self.decay_iters if self.decay_iters is not None else train_iters
        if self.decay_style == "wsd":
            return end - round(self.wsd_decay_fraction * end), end
        return self.warmup_iters, end


@dataclass
class TrainConfig:
    """The optimisation loop."""

    train_iters: int = opt(1000, "optimizer steps to train for")
    lr: float = opt(3e-4, "peak learning rate (after warmup)")
    micro_batch_size: int = opt(1, "samples per rank per forward/backward")
    global_batch_size: int | None = opt(
        None, "samples per optimizer step over all replicas (default micro x data-parallel); must be a multiple of it"
    )
    grad_clip: float = opt(1.0, "clip the global gradient norm to this (0: off)")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = opt(
        "auto", "parameter/activation precision: auto = bf16 on CUDA (tensor cores), fp32 on CPU (no native bf16 "
        "there); fp16: GPU only, dynamic loss scaling",
    )
    grad_accum_dtype: Literal["fp32", "bf16"] = opt(
        "fp32", "bf16 runs: dtype of micro-batch gradient accumulation and reduction (bf16: DeepSpeed's plain behaviour, an ablation)"
    )
    fp16_initial_scale_power: int = opt(16, "fp16: initial loss scale 2^this")
    fp16_loss_scale_window: int = opt(1000, "fp16: steps without overflow before the scale grows")
    fp16_hysteresis: int = opt(2, "fp16: overflows tolerated before the scale shrinks")
    fp16_min_loss_scale: float = opt(1.0, "fp16: lower bound of the loss scale")
    seed: int = opt(1234, "seed of parameters, data order and dropout")
    device: Literal["auto", "cpu", "cuda"] = opt(
        "auto", "where to train (auto: cuda when available; cuda: unusable CUDA is an error naming the cause)"
    )
    eval_interval: int = opt(0, "run validation every this many steps (0: only at the end, if valid_path is set)")
    eval_iters: int = opt(10, "validation micro-batches per rank per evaluation (0: no validation)")
    max_nonfinite_in_a_row: int = opt(5, "abort after this many consecutive steps with non-finite loss or grad norm")
    compile: bool = opt(
        False, "torch.compile each transformer block (per block, torchtitan's way; the attention core stays eager "
        "behind a graph break). Not with pipeline parallelism. The first step pays the compile (tens of seconds on "
        "CPU); see docs/training.md for where it pays",
    )
    loss_chunk_tokens: int = opt(
        DEFAULT_LOSS_CHUNK_TOKENS, "> 0: the output projection and cross-entropy run this many tokens at a time, "
        "recomputed in backward, so the whole [tokens x vocab] logits and their gradient never exist (also under TP, "
        "with the vocab-parallel loss); 0: the whole logits. Not under pipeline parallelism (the last stage keeps them)",
    )


@dataclass
class CheckpointConfig:
    """Atomic DeepSpeed checkpoints with exact-resume client state."""

    dir: str | None = opt(None, "checkpoint directory (default <logging.run_dir>/checkpoints)")
    save_interval: int = opt(0, "save every this many steps (0: only at the end and on SIGTERM/SIGUSR1)")
    keep_last: int = opt(3, "complete checkpoints kept; older ones are deleted after a successful save")
    resume: str = opt("auto", "`auto`: newest complete checkpoint in dir if any; `none`: start fresh; or a checkpoint path/tag")
    save_on_signal: bool = opt(True, "on SIGTERM/SIGINT/SIGUSR1 (preemption) or a dead launcher: save after the current step, exit 75")
    save_at_end: bool = opt(True, "save after the last step")
    background: bool = opt(
        False, "save without stopping training: copy the state to host memory (one more copy of this rank's "
        "checkpoint shard in RAM while it is written), write and hash it on a thread, commit at a later step "
        "boundary; at most one save in flight (the next save, the end of training and a stop signal wait for it)",
    )
    zero_universal_resume: bool = opt(
        True, "resuming a ZeRO 1-3 checkpoint (TP 1) with another DP x CP product: convert it once to DeepSpeed's "
        "universal form (<dir>/universal/<tag>) and repartition its optimizer states; off: such a resume is an error",
    )
    init_from: str | None = opt(
        None, "warm start: a checkpoint folder, checkpoint dir or run dir (any ZeRO stage / TP size) whose weights are "
        "copied into the model at a fresh start (ignored when resuming this run's own checkpoint); recorded in the metadata",
    )
    init_parameters: Literal["all", "kernel", "non_kernel"] = opt(
        "all", "what `init_from` copies: `all` (kernel parameters the source lacks keep their fresh init, e.g. a softmax "
        "source), `kernel` (the parameters the feature maps declare: Omega, tau, ...) or `non_kernel` (everything else)",
    )


@dataclass
class ProfileConfig:
    """``logging.profile``: a torch.profiler trace of a few optimizer steps."""

    start: int = opt(1, "first profiled optimizer step (1-based, as logged)")
    steps: int = opt(3, "profiled steps: start .. start + steps - 1")


@dataclass
class WandbConfig:
    """``logging.wandb``: Weights & Biases logging of the scalars and the resolved config (rank 0)."""

    project: str = opt("megaflex", "W&B project")
    name: str | None = opt(None, "run name (default: the name of logging.run_dir)")
    entity: str | None = opt(None, "W&B entity (team or user; default: the logged-in user's)")
    mode: Literal["online", "offline", "disabled"] = opt("online", "`offline`: write to disk only (`wandb sync` later)")
    tags: list[str] = opt([], "run tags")


@dataclass
class LoggingConfig:
    """Console, TensorBoard, metrics.jsonl and W&B (rank 0); torch.profiler windows (every rank)."""

    run_dir: str = opt("runs/default", f"directory of this run: metrics.jsonl, tensorboard/, config.yaml, {CHECKPOINTS_DIR}/")
    log_interval: int = opt(1, "log (console, TensorBoard, metrics.jsonl) every this many steps")
    tensorboard: bool = opt(True, "write TensorBoard scalars to <run_dir>/tensorboard")
    progress_bar: bool = opt(True, "console progress bar (plain lines when stdout is not a terminal)")
    kernel_stats_interval: int = opt(10, "log per-layer tau and Omega statistics every this many steps (0: off)")
    peak_tflops: float | None = opt(None, "per-device peak TFLOP/s for MFU (default: known GPU table, else not logged)")
    wandb: WandbConfig | None = opt(
        None, "Weights & Biases (pip install 'megaflex[wandb]'): `{project, name, entity, mode: online|offline|disabled, "
        "tags}`; the TensorBoard scalars and the resolved config from rank 0; a resumed run continues the same W&B run "
        "(its id is kept in <run_dir>/wandb_run_id); files under $WANDB_DIR, else <run_dir>/wandb",
    )
    profile: ProfileConfig | None = opt(
        None, "`{start: N, steps: K}`: torch.profiler (CPU, + CUDA on GPU) over steps N .. N+K-1; every rank writes "
        "<run_dir>/profile/rank<r>.steps<N>-<M>.pt.trace.json (Chrome / TensorBoard trace) and .ops.json (per-op "
        "counts and self times), rank 0 logs the top ops by self time",
    )


@dataclass
class FaultConfig:
    """Fault injection, for tests of skipping and crash recovery. Leave unset in real runs."""

    nan_loss_at_steps: list[int] = opt([], "make rank 0's loss NaN at these steps (tests the non-finite skip)")
    inf_grad_at_steps: list[int] = opt(
        [], "make rank 0's gradients infinite (its loss stays finite) at these steps (tests DeepSpeed's overflow skip)"
    )
    sigkill_after_step: int | None = opt(None, "every rank kill -9s itself after this step is logged")
    sigstop_last_rank_after_step: int | None = opt(
        None, "the last rank SIGSTOPs itself after this step (a frozen peer: tests parallel.timeout_minutes)"
    )
    sigkill_during_save_at_step: int | None = opt(
        None, "every rank is killed with kill -9 in the save at this step, after the shards are written but before the "
        "commit (checkpoint.background: from the writer thread, once its first file is written); the first rank there "
        "kills its node's ranks at once"
    )
    sigterm_during_save_at_step: int | None = opt(
        None, "every rank sends itself SIGTERM in the save at this step, before the commit (a preemption mid-save; "
        "checkpoint.background: from the writer thread, once its first file is written)"
    )
    sigterm_during_startup: bool = opt(False, "every rank sends itself SIGTERM once the model is built, before the engine")


@dataclass
class DistillConfig:
    """``megaflex-distill``: convert a softmax checkpoint into a linear-attention model (ignored by megaflex-train)."""

    teacher: str | None = opt(None, "the softmax teacher: a megaflex checkpoint folder, checkpoint dir or run dir (any ZeRO / TP)")
    stage: Literal["attention_transfer", "finetune"] = opt(
        "attention_transfer", "`attention_transfer`: per-layer losses on the teacher's attention inputs, only the kernel "
        "(+ out_gain) trains; `finetune`: LM loss (+ KL to the teacher), all parameters or LoRA",
    )
    student_attention: str = opt("flexformer_n", "the student's attention kind (any linear kind; the teacher's model config otherwise)")
    output_mse_weight: float = opt(1.0, "attention_transfer: weight of the per-layer attention-output MSE")
    weights_ce_weight: float = opt(
        0.0, "attention_transfer: weight of the per-layer cross-entropy between the teacher's softmax weights and the "
        "student's normalised linear weights on the first `weights_window` tokens (minus the teacher's entropy: 0 at a match)",
    )
    weights_window: int = opt(64, "attention_transfer: tokens of the quadratic attention-weights loss")
    kl_weight: float = opt(0.0, "finetune: weight of KL(teacher logits || student logits) added to the LM loss")
    lora_rank: int = opt(0, "finetune: LoRA rank on `lora_targets` (0: train all parameters)")
    lora_alpha: float = opt(16.0, "finetune: LoRA scale alpha (update = alpha / rank * B @ A)")
    lora_targets: list[str] = opt(["qkv", "proj"], "finetune: the linears that get LoRA adapters (qkv, proj, fc_in, fc_out)")


@dataclass
class Config:
    """A complete run: every section of the YAML files."""

    model: ModelConfig
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    # key -> file it came from ("defaults" when never set); not part of the YAML
    origins: dict[str, str] = field(default_factory=dict, repr=False, compare=False, metadata={"internal": True})

    def where(self, key: str) -> str:
        """Source (file or ``command line``) of a dotted key, for error messages."""
        return self.origins.get(key, "defaults")

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or str(run_checkpoint_dir(self.logging.run_dir))

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict of every section (the resolved config saved with checkpoints)."""
        return {name: to_dict(getattr(self, name)) for name in SECTIONS}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


SECTIONS = ("model", "data", "parallel", "optimizer", "schedule", "train", "checkpoint", "logging", "fault", "distill")

_POSITIVE, _NON_NEGATIVE, _FRACTION = Range(0.0, low_open=True), Range(0.0), Range(0.0, 1.0)
# The range of every float key, checked (with finiteness) by the loader as each value is read;
# tests/training/test_training_config.py fails for a float field missing here.
FLOAT_RANGES: dict[str, Range] = {
    "model.norm_eps": _POSITIVE, "model.hidden_dropout": _FRACTION, "model.attention_dropout": _FRACTION,
    "model.rope_theta": _POSITIVE, "model.init_std": _POSITIVE,
    "data.train_weights": _NON_NEGATIVE,
    "parallel.timeout_minutes": _POSITIVE,
    "optimizer.beta1": _FRACTION, "optimizer.beta2": _FRACTION, "optimizer.eps": _POSITIVE,
    "optimizer.weight_decay": _NON_NEGATIVE,
    "optimizer.kernel_frequency_lr_multiplier": _NON_NEGATIVE,
    "optimizer.kernel_temperature_lr_multiplier": _NON_NEGATIVE,
    "schedule.min_lr": _NON_NEGATIVE, "schedule.wsd_decay_fraction": Range(0.0, 1.0, low_open=True, high_open=False),
    "train.lr": _POSITIVE, "train.grad_clip": _NON_NEGATIVE, "train.fp16_min_loss_scale": _POSITIVE,
    "logging.peak_tflops": _POSITIVE,
    "distill.output_mse_weight": _NON_NEGATIVE, "distill.weights_ce_weight": _NON_NEGATIVE,
    "distill.kl_weight": _NON_NEGATIVE, "distill.lora_alpha": _POSITIVE,
}
