"""Where launch/train.sh trains: prints "cuda <visible GPUs>" or "cpu 0", or refuses.

    python launch/resolve_device.py [megaflex-train arguments]

The configs' ``train.device`` decides (with its overrides): ``cpu`` trains on CPU ranks (gloo);
``cuda`` needs a usable CUDA; ``auto`` uses CUDA when usable and CPU only on a node without NVIDIA
GPUs. A node whose GPUs torch cannot use is an error naming the cause (exit 2), never a silent
CPU/gloo run: ask for CPU with ``train.device=cpu``.
"""

from __future__ import annotations

import sys

from megaflex.parallel.launcher_env import cuda_unusable_reason, nvidia_device_files


def requested_device(argv: list[str]) -> str:
    """``train.device`` of these megaflex-train arguments ("auto" when they do not parse: the
    trainer then reports the argument or config error itself)."""
    from megaflex.training.config import ConfigError, load_config
    from megaflex.training.train import parse_args

    try:
        args = parse_args(argv)
        return load_config(args.config, args.overrides).train.device
    except (SystemExit, ConfigError):
        return "auto"


def main(argv: list[str]) -> int:
    requested = requested_device(argv)
    if requested == "cpu":
        print("cpu 0")
        return 0
    reason = cuda_unusable_reason()
    if reason is None:
        import torch

        print(f"cuda {torch.cuda.device_count()}")
        return 0
    hint = "pass train.device=cpu to train on CPU ranks (gloo) instead"
    if requested == "cuda":
        print(f"error: train.device is cuda but CUDA is unusable: {reason}; {hint}", file=sys.stderr)
        return 2
    devices = nvidia_device_files()
    if devices:
        print(f"error: this node has NVIDIA GPUs ({', '.join(devices)}) but CUDA is unusable: {reason}; {hint}",
              file=sys.stderr)  # fmt: skip
        return 2
    print("[train.sh] no NVIDIA GPU on this node: CPU ranks over gloo", file=sys.stderr)
    print("cpu 0")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
