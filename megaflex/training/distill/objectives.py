"""The two stages of ``megaflex-distill`` as trainer objectives (``megaflex.training.trainer.Objective``).

* ``AttentionTransfer``: only the linear-attention parameters train (kernel parameters declared
  by the feature maps + the per-head ``out_gain``); everything else is frozen (requires_grad
  False, so not in the optimizer: bit-identical after a step). Loss = sum over layers of
  ``output_mse_weight`` x output MSE + ``weights_ce_weight`` x attention-weights KL (see losses.py).
* ``Finetune``: the LM loss (+ ``kl_weight`` x KL to the teacher's logits) on all parameters,
  or LoRA adapters (``lora_rank`` > 0, ``megaflex.parallel.lora``); at the end the adapters are
  merged and the weights written as a weights-only checkpoint (``megaflex.checkpoint.merged_checkpoint_dir``).

The teacher is built once per rank with the student's layer factory (same TP layout), loaded
from its checkpoint (resharded to this TP size), frozen, in eval mode and outside the DeepSpeed
engine. Building it leaves the default and TP-tracker RNG streams as they were.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megaflex.checkpoint import (
    CheckpointMeta, load_checkpoint_weights, merged_checkpoint_dir, parameter_shapes, save_weights_only,
)
from megaflex.model.config import ModelConfig
from megaflex.model.gpt import GPT, IGNORE_INDEX
from megaflex.training.config import Config, DistillConfig
from megaflex.training.config_loader import ConfigError
from megaflex.training.distill.losses import (
    AttentionTap, attention_weights, captured_qk, logits_kl, output_mse, supports_attention_weights, tp_sum, weights_kl,
)
from megaflex.training.weights import linear_attention_parameter_names


def load_teacher(checkpoint: str | os.PathLike, layers: Any) -> GPT:
    """The frozen fp32 softmax teacher from ``checkpoint``, parallelised as the student is
    (``layers``: the student's factory, which it then runs through too)."""
    from megaflex.checkpoint.reshard import load_state_dict_checked
    from megaflex.parallel import TensorParallelLayers, parallelize_with

    try:
        state, meta, path = load_checkpoint_weights(checkpoint, layers.tp_size, layers.tp_rank)
    except ValueError as e:
        raise ConfigError(f"distill.teacher: {e}") from None
    config = ModelConfig.from_dict(meta.model_config)
    check_softmax_teacher(config, path)
    with torch.random.fork_rng(devices=[]):  # its (overwritten) init must not move the student's stream
        teacher = GPT(config)
    if isinstance(layers, TensorParallelLayers):  # parallelising draws no random numbers
        parallelize_with(teacher, layers, config)
    load_state_dict_checked(teacher, state)
    teacher.requires_grad_(False)
    return teacher.eval()


def run_teacher(teacher: GPT, ids: torch.Tensor) -> Any:
    """The teacher's forward on ``ids`` without autograd, on ``ids``' device (moved there at first use:
    the student only reaches its device inside ``deepspeed.initialize``)."""
    if next(teacher.parameters()).device != ids.device:
        teacher.to(ids.device)
    with torch.no_grad():
        return teacher(ids)


def check_softmax_teacher(config: ModelConfig, path: Any) -> None:
    """ConfigError unless the teacher checkpoint at ``path`` holds a softmax model."""
    if config.attention != "softmax":
        raise ConfigError(f"distill.teacher: {path} is a model.attention={config.attention!r} model; expected a softmax teacher")


def check_student_matches_teacher(student: ModelConfig, teacher: ModelConfig) -> None:
    """ConfigError naming every shape-defining field where the student differs from the teacher."""
    fields = ("vocab_size", "num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "mlp", "norm", "bias",
              "tie_embeddings", "position")
    diff = {f: (getattr(teacher, f), getattr(student, f)) for f in fields if getattr(teacher, f) != getattr(student, f)}
    if diff:
        text = ", ".join(f"model.{f}: teacher {t!r}, student {s!r}" for f, (t, s) in diff.items())
        raise ConfigError(f"distill: the student must have the teacher's shape except its attention; {text}")


def _check_runtime(cfg: Config, stage: str) -> None:
    if cfg.parallel.context_parallel_size > 1:
        raise ConfigError(f"parallel.context_parallel_size: distillation ({stage}) runs without context "
                          f"parallelism; expected 1, got {cfg.parallel.context_parallel_size}")
    if cfg.parallel.sequence_parallel:  # its taps and LoRA adapters read the whole residual stream
        raise ConfigError(f"parallel.sequence_parallel: distillation ({stage}) runs without sequence parallelism; "
                          "expected false, got true")


class AttentionTransfer:
    """Stage 1: train the student's kernels to reproduce the teacher's attention, layer by layer."""

    def __init__(self, dc: DistillConfig) -> None:
        self.dc = dc
        self.teacher: GPT | None = None
        self.tap: AttentionTap | None = None

    def prepare(self, model: GPT, cfg: Config) -> None:
        _check_runtime(cfg, "attention_transfer")
        trainable = linear_attention_parameter_names(model)
        if not trainable:
            raise ConfigError(f"model.attention={model.config.attention!r} (normalization "
                              f"{model.config.normalization!r}) has no kernel parameters or gains to train in attention_transfer")
        for name, param in model.named_parameters():
            param.requires_grad_(name in trainable)
        if self.dc.weights_ce_weight > 0 and not all(supports_attention_weights(b.attn.core) for b in model.blocks):
            raise ConfigError("distill.weights_ce_weight: the attention-weights loss needs a plain feature-map core "
                              "(no model.softmax_window / model.qkv_conv_size); set it to 0")
        self.teacher = load_teacher(self.dc.teacher, model.layer_factory)
        check_student_matches_teacher(model.config, self.teacher.config)
        self.tap = AttentionTap(self.teacher)
        self.tp_group = getattr(getattr(model.layer_factory, "state", None), "tp_group", None)

    def layer_losses(self, student: GPT, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Sum of the weighted per-layer losses and each layer's terms (also used by tests)."""
        self.tap.clear()
        run_teacher(self.teacher, ids)
        dtype = next(student.parameters()).dtype
        total = torch.zeros((), dtype=torch.float32, device=ids.device)
        terms: dict[str, torch.Tensor] = {}
        for i, block in enumerate(student.blocks):
            with captured_qk(block.attn.core) as qk:
                out, _ = block.attn(self.tap.inputs[i].to(dtype))
            if self.dc.output_mse_weight > 0:
                terms[f"layer_{i}_output_mse"] = mse = output_mse(out, self.tap.outputs[i])
                total = total + self.dc.output_mse_weight * mse
            if self.dc.weights_ce_weight > 0:
                window = self.dc.weights_window
                teacher_w = attention_weights(self.teacher.blocks[i].attn.core, *self.tap.qk[i], window)
                student_w = attention_weights(block.attn.core, *qk[0], window)
                kl = tp_sum(weights_kl(teacher_w, student_w, student.config.num_heads), self.tp_group)
                terms[f"layer_{i}_weights_kl"] = kl
                total = total + self.dc.weights_ce_weight * kl
        return total, terms

    def loss(self, engine: Any, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.layer_losses(engine.module, ids)

    def finish(self, engine: Any, iteration: int) -> None:
        pass


class Finetune:
    """Stage 2: LM loss (+ KL to the teacher) on all parameters or on LoRA adapters."""

    def __init__(self, dc: DistillConfig) -> None:
        self.dc = dc
        self.teacher: GPT | None = None
        self.cfg: Config | None = None

    def prepare(self, model: GPT, cfg: Config) -> None:
        _check_runtime(cfg, "finetune")
        self.cfg = cfg
        if self.dc.lora_rank > 0:
            if cfg.parallel.zero_stage == 3:
                raise ConfigError("distill.lora_rank: LoRA runs with parallel.zero_stage 0-2 (merging needs whole "
                                  "weights); got 3")
            from megaflex.parallel.lora import add_lora

            add_lora(model, self.dc.lora_rank, self.dc.lora_alpha, tuple(self.dc.lora_targets))
        if self.dc.kl_weight > 0:
            self.teacher = load_teacher(self.dc.teacher, model.layer_factory)
            check_student_matches_teacher(model.config, self.teacher.config)
            model.set_loss_chunk_tokens(0)  # the KL reads the student's whole logits (train.loss_chunk_tokens)

    def loss(self, engine: Any, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = engine(ids, labels)
        if self.teacher is None:
            return out.loss, {}
        teacher_logits = self.teacher.gather_logits(run_teacher(self.teacher, ids).logits)
        kl = logits_kl(teacher_logits, engine.module.gather_logits(out.logits), labels, IGNORE_INDEX)
        return out.loss + self.dc.kl_weight * kl, {"lm_loss": out.loss, "teacher_kl": kl}

    def finish(self, engine: Any, iteration: int) -> None:
        if self.dc.lora_rank > 0:
            export_merged(engine, self.cfg, iteration)


def export_merged(engine: Any, cfg: Config, iteration: int) -> Path:
    """Collective. Merge the LoRA adapters into the weights and commit them as a weights-only
    checkpoint in ``merged_checkpoint_dir(run_dir)`` (metadata taken from the run's newest
    checkpoint) that megaflex-eval / megaflex-generate / ``checkpoint.init_from`` read."""
    from megaflex.checkpoint import select_checkpoint
    from megaflex.parallel.lora import merge_lora

    model = engine.module
    merge_lora(model)
    factory = model.layer_factory
    state = getattr(factory, "state", None)
    dp_rank = state.dp_rank if state is not None else 0
    rank = dist.get_rank() if dist.is_initialized() else 0
    weights = None
    if dp_rank == 0:  # one writer per TP rank
        weights = {k: (v.float() if v.is_floating_point() else v).detach().cpu().clone() for k, v in model.state_dict().items()}
    meta = None
    if rank == 0:
        newest, _ = select_checkpoint(cfg.checkpoint_dir, "auto")
        meta = CheckpointMeta.read(newest)
        meta.files = None
        meta.parameter_shapes, meta.zero_stage, meta.precision = parameter_shapes(model), 0, "fp32"
        meta.lora_merged, meta.iteration = True, iteration
    root = merged_checkpoint_dir(cfg.logging.run_dir)
    return save_weights_only(root, iteration, factory.tp_rank, weights, meta, rank)
