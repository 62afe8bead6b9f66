"""The kernel study's configuration: kinds, Flexformer-N arms, presets, ``RunSpec`` and
``StudyConfig`` (shared by the study, its report and the studies built on it)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from megaflex.attention.feature_maps.common import log_sqrt_scale
from megaflex.cli_args import (
    creatable_dir, nonnegative_float, nonnegative_int, positive_float, positive_int, scratch_results, unit_interval,
)
from megaflex.model.config import LEGACY_MODEL_FIELDS
from megaflex.training.config import OptimizerConfig

REPO = Path(__file__).resolve().parents[1]
_PROJECT_OPTIMIZER = OptimizerConfig()
# the head dim of the cpu and cpu4x presets (128 / 4, 160 / 5): arms that set an absolute temperature use it
STUDY_HEAD_DIM = 32
_TAU_INIT = log_sqrt_scale(STUDY_HEAD_DIM)  # log(2 sqrt d) = 2.426
KINDS = ("softmax", "flexformer_n", "flexformer_s", "performer", "elu", "cosformer", "hedgehog")
LEARNED_SPECTRUM = {"flexformer_n": ("omega1", "omega2"), "flexformer_s": ("omega",)}
# Flexformer-N arms: (overrides of the default recipe, what they test)
ARMS: dict[str, tuple[list[str], str]] = {
    "fn_paper_init": (["model.feature_kwargs={omega_init: paper}"], "independent Omega1, Omega2 (the paper's init)"),
    "fn_tied_init": (["model.feature_kwargs={omega_init: tied}"], "Omega2 = Omega1 + noise (no uniform floor)"),
    "fn_kernel_lr_off": (
        ["optimizer.kernel_frequency_lr_multiplier=1", "optimizer.kernel_temperature_lr_multiplier=1"],
        "one LR for every parameter (kernel LR multipliers 1 instead of 10)",
    ),
    "fn_omega_frozen": (["optimizer.kernel_frequency_lr_multiplier=0"], "Omega frozen at init (tau still learned)"),
    "fn_hybrid": (["model.softmax_window=64", "model.window_mixing=gated"],
                  "plus exact softmax over the last 64 tokens, mixed in by a learned per-head gate (v2's hybrid)"),
    "fn_qkv_conv": (["model.qkv_conv_size=4"], "plus a 4-tap causal depthwise convolution of q, k, v"),
    # study v3: what the window and the kernel are each worth (docs/attention.md)
    **{f"fn_gated{w}": ([f"model.softmax_window={w}", "model.window_mixing=gated"],
                        f"plus exact softmax over the last {w} tokens, mixed in by a learned per-head gate") for w in (16, 64)},
    **{f"fn_window{w}": ([f"model.softmax_window={w}", "model.window_mixing=shared_normaliser"],
                         f"exact softmax weights for the last {w} keys, the learned kernel for older ones, one normaliser")
       for w in (16, 64)},
    **{f"fn_window{w}_denominator": ([f"model.softmax_window={w}", "model.window_mixing=shared_normaliser",
                                        "model.normalization=denominator"],
                                       f"fn_window{w} with the softmax-shaped output normalisation (the one-normaliser "
                                       "sum divided by its mass) instead of rms") for w in (16, 64)},
    **{f"fn_window{w}_capped": ([f"model.softmax_window={w}", "model.window_mixing=shared_normaliser",
                                   "model.normalization=capped_denominator"],
                                  f"fn_window{w} divided by its mass, with the denominator capped so the output's RMS "
                                  "stays <= 2 (attention/base.py), instead of rms") for w in (16, 64)},
    "fn_capped": (["model.normalization=capped_denominator"],
                  "the capped denominator (attention/base.py) instead of rms, no window"),
    **{f"performer_window{w}_capped": ([f"model.softmax_window={w}", "model.window_mixing=shared_normaliser",
                                        "model.normalization=capped_denominator"],
                                       f"performer_window{w} with the capped denominator instead of rms") for w in (16, 64)},
    **{f"performer_window{w}": ([f"model.softmax_window={w}", "model.window_mixing=shared_normaliser"],
                                f"Performer (a fixed kernel) for keys older than the last {w}, one normaliser") for w in (16, 64)},
    **{f"softmax_window{w}": ([f"model.softmax_window={w}"], f"sliding-window softmax over the last {w} tokens, no far field")
       for w in (16, 64)},
    "softmax_rms": (["model.softmax_window=1048576"],
                    "full softmax with the hybrids' output normalisation (rms): a window beyond every sequence"),
    # issue 46, remedy (a): inits without the paper init's uniform floor (feature_maps/flexformer_n.py)
    **{f"fn_tied_eta{eta}": ([f"model.feature_kwargs={{omega_init: tied, omega_noise: {eta}}}"],
                             f"Omega2 = Omega1 + {eta} x noise: every term estimates the softmax kernel, damped by "
                             f"exp(-{eta}^2 ||.||^2 / (2 sqrt d)) factors; no floor") for eta in ("0.3", "0.5", "1.0")},
    **{f"fn_corr_rho{rho}": ([f"model.feature_kwargs={{omega_init: correlated, omega_correlation: {rho}}}"],
                             f"Omega2 = {rho} Omega1 + sqrt(1 - {rho}^2) noise: E kernel = (exp(s) + exp({rho} s)) / 2, "
                             "no floor") for rho in ("0.5", "0.8")},
    # remedy (b): a bounded kernel temperature, and the x10 temperature LR over long schedules
    **{f"fn_tau_max{margin}": ([f"model.feature_kwargs={{max_log_temperature: {_TAU_INIT + float(margin):.4f}}}"],
                               f"tau capped at log(2 sqrt d) + {margin} = {_TAU_INIT + float(margin):.4f} (d = "
                               f"{STUDY_HEAD_DIM}; a soft ceiling, the identity below it - 0.4)") for margin in ("0.5", "1.0")},
    **{f"fn_tau_lr{m}": ([f"optimizer.kernel_temperature_lr_multiplier={m}"],
                         f"tau's LR multiplier {m} instead of 10 (Omega's stays 10)") for m in ("1", "3")},
    # remedy (c): norm control of q and k before the feature map (attention/qk_norm.py)
    "fn_qk_rms": (["model.qk_norm=rms"], "q, k <- g_h x / rms(x) before RoPE and the map, a learned per-head gain g_h"),
    "fn_qk_affine": (["model.qk_norm=affine_rms"], "q, k <- w * x / rms(x) + b (ReBased), per head and channel"),
    # remedy (e): the hybrid's learned per-head balance between the window and the far field (attention/hybrid.py)
    **{f"fn_window{w}_capped_far_gain": ([f"model.softmax_window={w}", "model.window_mixing=shared_normaliser",
                                           "model.normalization=capped_denominator", "model.window_far_gain=true"],
                                          f"fn_window{w}_capped with a learned per-head gain e^b_h (init 1) on the far "
                                          "field's weights against the window's") for w in (16, 64)},
    "fn_decay": (["model.kernel_decay=learned"], "plus a learned per-head decay gamma^(t - s) of old keys (RetNet init, attention/decay.py)"),
    "performer_decay": (["model.kernel_decay=learned"],
                        "Performer (the fixed kernel) with fn_decay's learned per-head decay: what the decay is worth "
                        "without the learned kernel, fn_decay's fixed-kernel counterpart"),
    "fn_window64_capped_decay": (["model.softmax_window=64", "model.window_mixing=shared_normaliser", "model.normalization=capped_denominator", "model.kernel_decay=learned"], "fn_window64_capped with the far field decayed by a learned gamma^(t - s - 64)"),
}
# arms whose overrides hold values computed for the study's head dim (``StudyConfig.runs`` checks it)
HEAD_DIM_ARMS = {f"fn_tau_max{margin}": STUDY_HEAD_DIM for margin in ("0.5", "1.0")}
# the kind an arm changes (default: flexformer_n)
ARM_KINDS = {"softmax_rms": "softmax", **{f"performer_window{w}{c}": "performer" for w in (16, 64) for c in ("", "_capped")},
             **{f"softmax_window{w}": "softmax" for w in (16, 64)}, "performer_decay": "performer"}
# the run an arm is one change away from, where it is not its kind's default recipe (``control_of``)
ARM_CONTROLS: dict[str, str] = {**{f"fn_window{w}_capped_far_gain": f"fn_window{w}_capped" for w in (16, 64)},
                                "fn_window64_capped_decay": "fn_window64_capped"}
# study v3's arms: with --kinds softmax,flexformer_n,cosformer (docs/studies.md "The kernel study")
V3_ARMS = ("softmax_rms",) + tuple(f"{arm}{w}" for w in (16, 64)
                                   for arm in ("softmax_window", "fn_window", "fn_gated", "performer_window"))  # fmt: skip
# ... and the capped denominator (attention/base.py), added in the study's third session
V3_ARMS += tuple(f"{arm}{w}_capped" for arm in ("fn_window", "performer_window") for w in (16, 64)) + ("fn_capped",)
# study v5 (issue 46): the controls (the window alone at today's code, the hybrids and Performer with the
# window) and the remedies of the learned kernel, each one change to the default recipe or to a hybrid
V5_KINDS = ("softmax", "flexformer_n", "performer")
V5_CONTROLS = tuple(f"softmax_window{w}" for w in (16, 64)) + tuple(
    f"{arm}{w}_capped" for w in (16, 64) for arm in ("fn_window", "performer_window")) + ("performer_decay",)
V5_REMEDIES = (
    "fn_tied_eta0.3", "fn_tied_eta0.5", "fn_tied_eta1.0", "fn_corr_rho0.5", "fn_corr_rho0.8",  # (a) no floor
    "fn_tau_max0.5", "fn_tau_max1.0", "fn_tau_lr1", "fn_tau_lr3",  # (b) a bounded temperature
    "fn_qk_rms", "fn_qk_affine",  # (c) norm control of q and k
    "fn_decay", "fn_window64_capped_decay",  # (d) a learned per-head decay of old keys
    "fn_window16_capped_far_gain", "fn_window64_capped_far_gain",  # (e) the hybrid's window / far-field balance
)
# named arm sets: ``--arms`` expands these names (e.g. --arms v5_controls,v5_remedies)
ARM_SETS: dict[str, tuple[str, ...]] = {"v3": V3_ARMS, "v5_controls": V5_CONTROLS, "v5_remedies": V5_REMEDIES}
ORDERS = ("seeds", "kinds")  # seed-major (a stopped study still has whole seeds) or kind-major
# StudyConfig fields that select runs or name places, not what a run computes: not fingerprinted
NOT_FINGERPRINTED = ("kinds", "arms", "seeds", "data_root", "work_dir", "out", "long_contexts")
# The normalisation runs of studies v1-v3 were trained with (configs/tiny.yaml's then), absent from their fingerprints.
LEGACY_NORMALIZATION = LEGACY_MODEL_FIELDS["normalization"]
DEFAULT_ARMS = ("fn_tied_init", "fn_kernel_lr_off", "fn_omega_frozen", "fn_hybrid")  # fn_paper_init = the default
# model/training shapes per preset (the rest of StudyConfig is shared)
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {},
    # one size up (issue 38): 2x the parameters (2.50M against 1.31M, embeddings included: the LM head
    # is a large share of the compute at this size) and 2x the tokens, so the same tokens per parameter
    # and ~4x the compute. The example, 8 layers x 256, is 5.6x the parameters: ~31x the compute
    # at the same tokens per parameter, beyond a CPU session.
    "cpu4x": dict(num_layers=6, hidden_size=160, num_heads=5, steps=600, warmup=100),
    # the cpu preset at 1,024-token sequences with the same tokens per run and per step (4 x 1,024 =
    # 16 x 256): a W = 64 window covers 6% of each sequence's keys instead of 25% (issue 46)
    "cpu1024": dict(seq_len=1024, micro_batch_size=4, global_batch_size=4),
    "41m": dict(vocab_size=32000, num_layers=8, hidden_size=512, num_heads=8, feature_dim=128, seq_len=1024,
                micro_batch_size=16, global_batch_size=64, steps=2000, lr=6e-4, min_lr=6e-5, warmup=200,
                eval_tokens=0, eval_batch_size=16, tokenizer_sentences=1_000_000),
}


def control_of(label: str) -> str | None:
    """The control an arm is compared with (its kind's default recipe unless ``ARM_CONTROLS`` names
    another run); None for a kind itself."""
    if label in KINDS:
        return None
    return ARM_CONTROLS.get(label, ARM_KINDS.get(label, "flexformer_n"))


@dataclass
class RunSpec:
    """One training run of the study: ``label`` names the kind or arm, ``overrides`` go to the trainer."""

    label: str
    kind: str
    overrides: list[str] = field(default_factory=list)


@dataclass
class StudyConfig:
    """Everything that defines the study; all runs share it except their kind/arm overrides and seed."""

    kinds: list[str] = field(default_factory=lambda: list(KINDS))
    arms: list[str] = field(default_factory=lambda: list(DEFAULT_ARMS))
    seeds: int = 3  # seeds seed, seed + 1, ...
    data_root: str = os.environ.get("MEGAFLEX_DATA", str(REPO.parent / "shared" / "data"))
    work_dir: str = "work_data/kernel_study"
    out: str = field(default_factory=lambda: str(scratch_results("kernel_study")))  # docs/results/...: only when named
    device: str = "cpu"
    preset: str = "cpu"
    # model (equal for every kind; linear kinds add their small feature-map parameters)
    vocab_size: int = 4096
    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    feature_dim: int = 64
    # training
    steps: int = 300
    seq_len: int = 256
    micro_batch_size: int = 8
    global_batch_size: int = 16
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup: int = 50
    seed: int = 1234
    # the project's default recipe (configs/tiny.yaml, the base config of every run, sets both to 1)
    kernel_frequency_lr_multiplier: float = _PROJECT_OPTIMIZER.kernel_frequency_lr_multiplier
    kernel_temperature_lr_multiplier: float = _PROJECT_OPTIMIZER.kernel_temperature_lr_multiplier
    # data / evaluation
    max_train_docs: int | None = None  # None: both english-docs train shards
    tokenizer_sentences: int = 200_000
    eval_tokens: int = 200_000  # cap per evaluation set (first N tokens; 0: the whole set)
    eval_batch_size: int = 16
    # data.document_boundaries of every run ("reset": no attention across an EOD in packed samples)
    document_boundaries: str = "none"
    # model.normalization of every run an arm does not set (the project default since study v4;
    # v1-v3 ran under "rms", the default then, which their fingerprints leave implicit)
    normalization: str = "capped_denominator"
    # also score english-docs valid at these context lengths, in windows and stateful modes
    # (columns english_docs_valid_ppl_<mode><N>); evaluation only, not fingerprinted
    long_contexts: list[int] = field(default_factory=list)

    @property
    def tokens_per_run(self) -> int:
        return self.steps * self.global_batch_size * self.seq_len

    @property
    def seed_list(self) -> list[int]:
        return [self.seed + i for i in range(self.seeds)]

    @property
    def kernel_stats_interval(self) -> int:
        return max(1, self.steps // 20)

    def runs(self) -> list[RunSpec]:
        """The kinds with the default recipe, then the arms."""
        head_dim = self.hidden_size // self.num_heads
        wrong = [a for a in self.arms if HEAD_DIM_ARMS.get(a, head_dim) != head_dim]
        if wrong:
            raise ValueError(f"--arms: {wrong} set temperatures computed for head dim {STUDY_HEAD_DIM} (the cpu and "
                             f"cpu4x presets), this study has {head_dim}; leave them out")
        return [RunSpec(k, k) for k in self.kinds] + [RunSpec(a, ARM_KINDS.get(a, "flexformer_n"), list(ARMS[a][0]))
                                                      for a in self.arms]  # fmt: skip


# ------------------------------------------------------------------------------- option types
# What each numeric option of the studies accepts, checked while the arguments are parsed: a count
# >= 1 unless listed (0 or a negative count failed after the data was prepared, or never).
_NUMBER_TYPES: dict[str, Callable[[str], Any]] = {
    "seed": int, "warmup": nonnegative_int, "eval_tokens": nonnegative_int, "lora_rank": nonnegative_int,
    "softmax_window": nonnegative_int,
    "lr": positive_float, "stage1_lr": positive_float, "stage2_lr": positive_float, "lora_alpha": positive_float,
    "min_lr": nonnegative_float, "kernel_frequency_lr_multiplier": nonnegative_float,
    "kernel_temperature_lr_multiplier": nonnegative_float, "stage_kernel_lr_multiplier": nonnegative_float,
    "output_mse_weight": nonnegative_float, "weights_ce_weight": nonnegative_float, "kl_weight": nonnegative_float,
    "max_token_fraction": unit_interval,
}


def number_type(name: str) -> Callable[[str], Any]:
    """The argparse type of the studies' numeric option ``name`` (a StudyConfig-style field name)."""
    return _NUMBER_TYPES.get(name, positive_int)


def path_option(text: str) -> str:
    """A path option, absolute: the studies train in subprocesses started in the repository, where a
    path relative to the caller's folder would name another one."""
    return str(Path(text).expanduser().absolute())


def output_dir_option(text: str) -> str:
    """An output folder (absolute) that exists or can be created: refused before any run if it
    cannot; created only when there is something to put there."""
    return str(creatable_dir(text))
