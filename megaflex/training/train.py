"""``megaflex-train`` / ``python -m megaflex.train``: train from YAML configs.

    megaflex-train --config configs/tiny.yaml configs/zero/zero1.yaml train.lr=3e-4 [--resume auto]

Under a launcher every rank runs this (``deepspeed --num_gpus N --module megaflex.train ...``);
``--local_rank`` (passed by older DeepSpeed launchers) is accepted and ignored.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from megaflex.training.config import ConfigError, load_config

# Exit statuses of megaflex-train (the deepspeed launcher passes a rank's non-zero status on).
EXIT_DONE = 0  # trained to train.train_iters
EXIT_ERROR = 1  # an unexpected error (traceback)
EXIT_CONFIG = 2  # bad config or checkpoint: missing, corrupt, incompatible, unwritable dir, disk full
EXIT_NONFINITE = 3  # train.max_nonfinite_in_a_row non-finite steps in a row
EXIT_PREEMPTED = 75  # stopped by SIGTERM/SIGINT/SIGUSR1 or a dead launcher, checkpoint saved (EX_TEMPFAIL)
# 128 + S: stopped by signal S during start-up, before any step, nothing saved (143 for SIGTERM, 130
# for SIGINT: what S's default action gives), with one line (stop_signals.StartupStop)


def build_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The options every training entry point shares (``megaflex-train``, ``megaflex-distill``)."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--config", nargs="+", required=True, help="YAML files, merged in order")
    ap.add_argument("--resume", default=None, help="auto | none | checkpoint path or tag (= checkpoint.resume=...)")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4 parallel.zero_stage=3")
    return ap


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    # `--config a.yaml b.yaml train.lr=1` puts the overrides into --config's list: move them.
    args.overrides = [c for c in args.config if "=" in c] + args.overrides
    args.config = [c for c in args.config if "=" not in c]
    if args.resume is not None:
        args.overrides.append(f"checkpoint.resume={args.resume}")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser(
        "megaflex-train", "Train a megaflex GPT with DeepSpeed. Positional key=value arguments override config keys."
    )
    return finish_args(ap.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print_once(f"megaflex-train: config error: {e}")
        return EXIT_CONFIG
    return execute("megaflex-train", cfg)


def print_once(line: str) -> None:
    """``line`` on stderr from the launch's rank 0 only (the other ranks print nothing): an error of
    the config is the same on every rank, and one copy per rank would bury it."""
    from megaflex.parallel.launcher_env import launch_rank

    if launch_rank(os.environ) == 0:
        print(line, file=sys.stderr)


def execute(prog: str, cfg: Any, objective: Any = None) -> int:
    """Run the trainer on every rank and map its failures to the exit statuses above."""
    from megaflex.training.run_lock import release_held
    from megaflex.training.stop_signals import end_startup, guard_startup

    if cfg.checkpoint.save_on_signal:  # a stop before the first step: one line, exit 128 + signum
        guard_startup(prog, cleanup=release_held)
    try:
        return _execute(prog, cfg, objective)
    finally:
        end_startup()


def _execute(prog: str, cfg: Any, objective: Any) -> int:
    from megaflex.data.indexed import DataError
    from megaflex.parallel.launcher_env import LaunchEnvError, apply_launcher_env

    try:  # srun / mpirun without RANK: this process's rank from the launcher, before torch.distributed
        apply_launcher_env()
    except LaunchEnvError as e:
        print(f"{prog}: launch error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    from megaflex.checkpoint import CheckpointError
    from megaflex.training.collective_timeout import describe_failure
    from megaflex.training.run_lock import release_held
    from megaflex.training.trainer import NonFiniteAbort, run, shutdown

    clean = False
    try:
        summary = run(cfg, objective)
        clean = True
    except ConfigError as e:
        print(f"{prog}: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except LaunchEnvError as e:  # e.g. LOCAL_RANK beyond the visible GPUs (launcher_env.local_cuda_device)
        print(f"{prog}: launch error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except CheckpointError as e:
        print(f"{prog}: checkpoint error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except DataError as e:  # corrupt index, ids >= vocab, tokenizer mismatch or missing
        print(f"{prog}: data error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except NonFiniteAbort as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_NONFINITE
    except Exception as e:
        message = describe_failure(e)  # a hung or vanished peer: one line naming step and collective
        if message is None:
            raise
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    finally:
        release_held()
        shutdown(clean)
    return EXIT_DONE if summary["stop_reason"] == "done" else EXIT_PREEMPTED

if __name__ == "__main__":
    sys.exit(main())
