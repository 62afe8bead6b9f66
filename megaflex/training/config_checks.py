"""Validation of a run config: ``validate`` (static, called by ``load_config``) and
``validate_runtime`` (needs the launched world size and the device), the run's parallel grid
(``parallel_dims``) and device (``resolve_device``). Every refusal is a ``ConfigError`` naming the
key and the file (or override) it came from."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from megaflex.attention.dispatch import refused_setting
from megaflex.parallel import config as parallel_config
from megaflex.parallel.state import ParallelDims
from megaflex.training.config_loader import ConfigError

if TYPE_CHECKING:
    from megaflex.training.config_sections import Config


def _bad(cfg: Config, key: str, message: str) -> ConfigError:
    return ConfigError(f"{key} (from {cfg.where(key)}): {message}")


@contextmanager
def _named_source(cfg: Config) -> Iterator[None]:
    """The parallel package's refusals as ConfigErrors naming where the key was set."""
    try:
        yield
    except parallel_config.ParallelConfigError as err:
        raise _bad(cfg, err.key, err.message) from None


def validate(cfg: Config) -> None:
    """Reject impossible combinations that need no knowledge of the world size or device."""
    t, s, d, c, lg = cfg.train, cfg.schedule, cfg.data, cfg.checkpoint, cfg.logging
    positive = {
        "train.train_iters": t.train_iters, "train.micro_batch_size": t.micro_batch_size,
        "train.max_nonfinite_in_a_row": t.max_nonfinite_in_a_row,
        "data.seq_len": d.seq_len, "checkpoint.keep_last": c.keep_last, "logging.log_interval": lg.log_interval,
        "train.fp16_loss_scale_window": t.fp16_loss_scale_window, "train.fp16_hysteresis": t.fp16_hysteresis,
    }
    f = cfg.fault
    unset_or_positive = {  # null is "the default" (or off); 0 was taken as null, or trained at min_lr throughout
        "train.global_batch_size": t.global_batch_size, "schedule.decay_iters": s.decay_iters,
        "fault.sigkill_after_step": f.sigkill_after_step, "fault.sigstop_last_rank_after_step": f.sigstop_last_rank_after_step,
        "fault.sigkill_during_save_at_step": f.sigkill_during_save_at_step,
        "fault.sigterm_during_save_at_step": f.sigterm_during_save_at_step,
    }
    positive.update({key: value for key, value in unset_or_positive.items() if value is not None})
    for key, value in positive.items():
        if value < 1:
            raise _bad(cfg, key, f"expected a positive integer, got {value}")
    non_negative = {
        "train.eval_interval": t.eval_interval, "train.eval_iters": t.eval_iters, "checkpoint.save_interval": c.save_interval,
        "schedule.warmup_iters": s.warmup_iters, "logging.kernel_stats_interval": lg.kernel_stats_interval,
        "train.fp16_initial_scale_power": t.fp16_initial_scale_power,
        "train.loss_chunk_tokens": t.loss_chunk_tokens,
    }
    for key, value in non_negative.items():
        if value < 0:
            raise _bad(cfg, key, f"expected >= 0, got {value}")
    if lg.profile is not None:
        for key, value in {"logging.profile.start": lg.profile.start, "logging.profile.steps": lg.profile.steps}.items():
            if value < 1:
                raise _bad(cfg, key, f"expected a positive integer, got {value}")
        if lg.profile.start > t.train_iters:
            raise _bad(cfg, "logging.profile.start", f"expected <= train.train_iters ({t.train_iters}), got {lg.profile.start}")
    if t.global_batch_size is not None and t.global_batch_size % t.micro_batch_size != 0:
        raise _bad(
            cfg, "train.global_batch_size",
            f"expected a multiple of train.micro_batch_size ({t.micro_batch_size}), got {t.global_batch_size}",
        )
    if d.seq_len > cfg.model.max_seq_len:
        raise _bad(cfg, "data.seq_len", f"expected <= model.max_seq_len ({cfg.model.max_seq_len}), got {d.seq_len}")
    if d.document_boundaries == "reset" and d.eod_token_id is None and not d.tokenizer:
        raise _bad(cfg, "data.document_boundaries", "'reset' needs the EOD id: set data.tokenizer or data.eod_token_id")
    if d.eod_token_id is not None and not 0 <= d.eod_token_id < cfg.model.vocab_size:
        # an id no token has: document_boundaries=reset would never cut (the resets would do nothing)
        raise _bad(cfg, "data.eod_token_id", f"expected an id in [0, model.vocab_size={cfg.model.vocab_size}), "
                                             f"got {d.eod_token_id}; the tokenizer's EOD id is the default (unset it)")
    if d.reset_positions and d.document_boundaries != "reset":
        raise _bad(cfg, "data.reset_positions", f"needs data.document_boundaries=reset, got {d.document_boundaries!r}")
    decay_first, decay_iters = s.decay_window(t.train_iters)
    if s.warmup_iters > decay_iters:
        raise _bad(cfg, "schedule.warmup_iters", f"expected <= decay iterations ({decay_iters}), got {s.warmup_iters}")
    _validate_wsd(cfg, decay_first, decay_iters)
    if s.min_lr > t.lr:
        raise _bad(cfg, "schedule.min_lr", f"expected <= train.lr ({t.lr}), got {s.min_lr}")
    _check_attention_settings(cfg)
    if not cfg.model.causal:
        raise _bad(cfg, "model.causal", "false builds a bidirectional encoder, which sees every token it is asked to "
                   "predict (its loss and perplexity mean nothing): language-model training needs model.causal=true; "
                   "train an encoder with python -m megaflex.training.classify")
    with _named_source(cfg):
        parallel_config.check_parallel(cfg)
    if t.compile and cfg.parallel.pipeline_parallel_size > 1:
        raise _bad(cfg, "train.compile", "not supported with parallel.pipeline_parallel_size > 1 (DeepSpeed's pipeline "
                   f"engine runs the blocks as its own stage layers), got {cfg.parallel.pipeline_parallel_size}; "
                   "set train.compile=false")
    dc = cfg.distill
    if dc.lora_rank < 0:
        raise _bad(cfg, "distill.lora_rank", f"expected >= 0, got {dc.lora_rank}")
    if dc.weights_window < 1:
        raise _bad(cfg, "distill.weights_window", f"expected a positive integer, got {dc.weights_window}")
    if d.source == "indexed" and not d.train_path:
        raise _bad(cfg, "data.train_path", "data.source is 'indexed' but no training data prefixes are given")
    if d.train_weights is not None and len(d.train_weights) != len(d.train_path):
        raise _bad(
            cfg, "data.train_weights",
            f"expected one weight per data.train_path entry ({len(d.train_path)}), got {len(d.train_weights)}",
        )
    if d.train_weights and not any(w > 0 for w in d.train_weights):
        raise _bad(cfg, "data.train_weights", f"expected at least one weight > 0 (they are >= 0), got {d.train_weights}")


def _check_attention_settings(cfg: Config) -> None:
    """What the attention dispatch table refuses for this run's settings beyond the model's own
    (``ModelConfig`` checks those when it is built): document resets and context parallelism of a
    bidirectional model. One ConfigError naming the key, before any process group exists."""
    model = cfg.model.attention_settings()
    run_settings = {
        "data.document_boundaries": dict(documents="restart_batched" if cfg.data.document_boundaries == "reset" else "none"),
        "parallel.context_parallel_size": dict(context_parallel=cfg.parallel.context_parallel_size > 1),
    }
    for key, setting in run_settings.items():
        refusal = refused_setting(**model, **setting)
        if refusal is not None:
            raise _bad(cfg, key, refusal.message)


def config_warnings(cfg: Config) -> list[str]:
    """One line per setting that has no effect in this config. Warnings, not errors: they come from
    ablations that switch a feature off over a base config (``document_boundaries=none``,
    ``softmax_window=0``), where the companion key is harmless and the run is the one asked for."""
    d, m, out = cfg.data, cfg.model, []
    if d.eod_token_id is not None and d.document_boundaries != "reset":
        out.append(f"WARNING: data.eod_token_id (from {cfg.where('data.eod_token_id')}) has no effect: it acts only "
                   f"with data.document_boundaries=reset, got {d.document_boundaries!r}")
    if cfg.where("model.window_mixing") != "defaults" and not m.softmax_window:
        out.append(f"WARNING: model.window_mixing={m.window_mixing} (from {cfg.where('model.window_mixing')}) has no "
                   "effect: it acts only with a window, model.softmax_window > 0, got 0")
    if cfg.where("train.loss_chunk_tokens") != "defaults" and cfg.train.loss_chunk_tokens \
            and cfg.parallel.pipeline_parallel_size > 1:
        out.append(f"WARNING: train.loss_chunk_tokens={cfg.train.loss_chunk_tokens} (from "
                   f"{cfg.where('train.loss_chunk_tokens')}) has no effect under pipeline parallelism: the last stage "
                   "computes the whole logits")
    return out


def _validate_wsd(cfg: Config, decay_first: int, decay_iters: int) -> None:
    """The WSD keys act only with decay_style wsd, and its decay fits after the warmup."""
    s = cfg.schedule
    if s.decay_style != "wsd":
        for key in ("schedule.wsd_decay_fraction", "schedule.wsd_decay_shape"):
            if cfg.where(key) != "defaults":
                raise _bad(cfg, key, f"only used with schedule.decay_style=wsd, got decay_style={s.decay_style!r}")
        return
    if decay_first == decay_iters:
        raise _bad(cfg, "schedule.wsd_decay_fraction",
                   f"{s.wsd_decay_fraction:g} of {decay_iters} decay iterations rounds to no decay step; raise it")
    if decay_first < s.warmup_iters:
        raise _bad(cfg, "schedule.wsd_decay_fraction",
                   f"the decay ({decay_iters - decay_first} of {decay_iters} iterations) overlaps the warmup "
                   f"(schedule.warmup_iters={s.warmup_iters}); expected at most {(decay_iters - s.warmup_iters) / decay_iters:g}")


def validate_runtime(cfg: Config, world_size: int, has_cuda: bool) -> None:
    """Reject combinations that depend on the launched world and the device; resolve
    ``train.precision: auto`` for the device."""
    t = cfg.train
    dp = parallel_dims(cfg, world_size).dp_size
    if t.global_batch_size is not None and t.global_batch_size % (t.micro_batch_size * dp) != 0:
        raise _bad(
            cfg, "train.global_batch_size",
            f"expected a multiple of micro_batch_size x data-parallel size ({t.micro_batch_size} x {dp}), "
            f"got {t.global_batch_size}",
        )
    device = resolve_device(cfg, has_cuda)
    if t.precision == "auto":  # resolved here, once: the engine, checkpoints and logs see the concrete value
        t.precision = "bf16" if device == "cuda" else "fp32"
    if t.precision == "fp16" and device != "cuda":
        raise _bad(cfg, "train.precision", "fp16 needs a GPU (dynamic loss scaling on CPU is unsupported); use bf16 or fp32")
    if cfg.parallel.backend == "nccl" and device != "cuda":
        raise _bad(cfg, "parallel.backend", "nccl needs CUDA; use gloo or auto on CPU")
    check_device(cfg, has_cuda)
    check_attention_backend(cfg, device)
    check_compile_enabled(cfg)


def check_compile_enabled(cfg: Config) -> None:
    """ConfigError when ``train.compile`` is on but torch.compile is switched off in this environment
    (it would then return the blocks uncompiled, silently)."""
    switched_off = [name for name in ("TORCHDYNAMO_DISABLE", "TORCH_COMPILE_DISABLE") if os.environ.get(name) == "1"]
    if cfg.train.compile and switched_off:
        raise _bad(cfg, "train.compile", f"torch.compile is disabled in this environment ({switched_off[0]}=1), "
                   "so the blocks would run eagerly; unset it or set train.compile=false")


def check_attention_backend(cfg: Config, device: str) -> None:
    """ConfigError when ``model.attention_backend`` cannot run on ``device`` (else the first
    forward raises deep inside the kernels, a traceback after the whole set-up)."""
    from megaflex.attention.triton import interpreter_enabled, triton_available

    backend = cfg.model.attention_backend
    if backend == "triton" and not triton_available():
        raise _bad(cfg, "model.attention_backend", "triton needs the triton package: pip install 'megaflex[gpu]', "
                   "or use model.attention_backend=auto")
    if backend == "triton" and device == "cpu" and not interpreter_enabled():
        raise _bad(cfg, "model.attention_backend", "triton on CPU runs only under Triton's interpreter: export "
                   "TRITON_INTERPRET=1 (slow, for tests) or use model.attention_backend=auto (torch on CPU)")
    if backend == "fla" and device == "cpu":
        raise _bad(cfg, "model.attention_backend", "fla runs on CUDA only; use model.attention_backend=auto on CPU")


def check_device(cfg: Config, has_cuda: bool) -> None:
    """ConfigError when ``train.device`` is cuda and CUDA is unusable (never a silent CPU run)."""
    if cfg.train.device == "cuda" and not has_cuda:
        from megaflex.parallel.launcher_env import cuda_unusable_reason

        reason = cuda_unusable_reason() or "torch.cuda.is_available() is False"
        raise _bad(cfg, "train.device", f"cuda requested but CUDA is unusable: {reason} (train.device=cpu trains on CPU)")


def parallel_dims(cfg: Config, world_size: int) -> ParallelDims:
    """The run's TP x CP x PP x DP grid on ``world_size`` ranks, validated against the model (ConfigError)."""
    with _named_source(cfg):
        return parallel_config.parallel_dims(cfg, world_size)


def resolve_device(cfg: Config, has_cuda: bool) -> str:
    """``train.device`` with ``auto`` resolved."""
    if cfg.train.device == "auto":
        return "cuda" if has_cuda else "cpu"
    return cfg.train.device
