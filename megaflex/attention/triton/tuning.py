"""Launch tuning of the Triton kernels: the (num_warps, num_stages) configs each kernel's autotuner
holds, their pruning per launch and the tuning key; and whether Triton's interpreter runs them.
Read by the kernels (``linear_kernels.py``, ``window_kernels.py``), the glue (``linear.py``) and the AOT
checks; its own module so the kernels import no glue (the glue imports the kernels on first use)."""

from __future__ import annotations

import os


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# (num_warps, num_stages) that ``triton.autotune`` picks from on CUDA (the first: the one config
# the interpreter runs). Only configs that fit shared memory on sm_80 and sm_90 and meet the
# bf16 spill targets at every shipped shape are listed (benchmarks/triton_aot.py compiles each
# one; tests/benchmarks/test_triton_aot.py asserts it). The chunk kernels hold C x C and C x Dv fp32 blocks:
# 8 warps keep them in registers (4 warps spilled 40-720 B at the shipped shapes in bf16), and
# the scans' 4-warp config spilled up to 144 B with 1 or 3 stages.
_SCAN_CONFIGS = ((4, 2), (8, 2))
_CHUNK_CONFIGS = ((8, 1), (8, 2))
# With trig features computed in the kernels (TRIG) the autotuner prunes to these: 4 warps
# spilled 24-580 B (scans, trig_grads) and chunk_grads_v 8 B with 2 stages, at 247M and 1.3B.
_TRIG_SCAN_CONFIGS = ((8, 2),)
_TRIG_CHUNK_CONFIGS = ((8, 1),)
SCAN_KERNELS = ("chunk_states", "chunk_state_grads", "trig_grads")
MAP_KERNELS = ("trig_grads",)  # kernels of the trig map alone: always TRIG
# tuning key: the shapes and block sizes (not N: the best config hardly depends on the length,
# and re-tuning at every new length would benchmark again); tensor dtypes are added by Triton
TUNING_KEY = ("F", "DV", "DIN", "CHUNK", "BF", "BV", "BJ", "BD", "BK", "RMS", "BACKWARD", "TRIG", "PAIRED")


def launch_configs(kernel: str, *, trig: bool | None = None, interpreted: bool = False) -> list[tuple[int, int]]:
    """(num_warps, num_stages) configs of ``kernel``: every one its autotuner holds on CUDA
    (``trig`` None), the ones it may pick at launches with (True) or without (False) in-kernel trig
    features, or the single fixed one under the interpreter (which ignores them, and cannot benchmark)."""
    scan = kernel in SCAN_KERNELS
    if kernel in MAP_KERNELS or trig:
        configs = list(_TRIG_SCAN_CONFIGS if scan else _TRIG_CHUNK_CONFIGS)
    elif trig is False:
        configs = list(_SCAN_CONFIGS if scan else _CHUNK_CONFIGS)
    else:  # the union, in the plain configs' order
        configs = list(dict.fromkeys((_SCAN_CONFIGS + _TRIG_SCAN_CONFIGS) if scan else (_CHUNK_CONFIGS + _TRIG_CHUNK_CONFIGS)))
    return configs[:1] if interpreted else configs


def prune_launch_configs(kernel: str, configs: list, constexprs: dict) -> list:
    """The autotuner's ``early_config_prune``: of ``configs`` (triton.Config), those
    ``launch_configs`` allows at a launch with these constexprs (TRIG or not)."""
    allowed = set(launch_configs(kernel, trig=bool(constexprs.get("TRIG", False))))
    return [c for c in configs if (c.num_warps, c.num_stages) in allowed]
