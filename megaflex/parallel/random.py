"""Tensor-parallel-aware random number generation (Megatron's ``CudaRNGStatesTracker``, CPU too).

Two streams per process:

* the *default* torch RNG, seeded identically on every TP rank, so that anything computed on
  replicated activations (dropout after a row-parallel reduce, embedding dropout) is the same
  on all ranks of a TP group — otherwise the replicas of one activation silently diverge;
* a *model-parallel* stream seeded with ``seed + 2718 + tp_rank``, entered with
  ``tracker.fork()``, for random ops on *sharded* activations (e.g. attention-probability or
  MLP-hidden dropout inside column-parallel regions), which must differ between shards so the
  TP model drops independent units, like the unsharded model would.

The tracker is an ordinary object (no globals); ``get_states``/``set_states`` checkpoint it.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Iterator

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
TP_SEED_OFFSET = 2718  # Megatron's constant, kept so seeds are recognisable


def _get_rng_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _state_from_seed(seed: int, device: torch.device) -> torch.Tensor:
    """The generator state ``manual_seed(seed)`` would produce, without touching the default RNG."""
    if device.type == "cuda":
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        return gen.get_state()
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen.get_state()


class TensorParallelRNGTracker:
    """Named RNG streams that can be swapped into the default generator of one device.

    ``fork(name)`` swaps the named stream in, runs the block, stores the advanced stream and
    restores the default one, so random ops outside the block are unaffected by how many
    draws happened inside it.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"name: RNG stream {name!r} already exists")
        if seed in self._seeds:
            raise ValueError(f"seed: {seed} is already used by another stream")
        self._seeds.add(seed)
        self._states[name] = _state_from_seed(seed, self.device)

    def reset(self) -> None:
        self._states.clear()
        self._seeds.clear()

    def get_states(self) -> dict[str, torch.Tensor]:
        """Copies of all stream states (for checkpoints)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restore states saved by ``get_states`` (replaces all streams)."""
        self._states = {name: state.clone() for name, state in states.items()}

    def checkpoint_context(self) -> tuple[ContextManager[None], ContextManager[None]]:
        """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.

        torch restores only the default RNG for the recompute; this also replays the tracker's
        streams, so dropout inside ``fork()`` draws the same masks in the recompute as in the
        forward (Megatron's ``CheckpointFunction`` does the same)::

            checkpoint(block, x, use_reentrant=False, context_fn=tracker.checkpoint_context)
        """
        at_forward = self.get_states()

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            current = self.get_states()
            self.set_states(at_forward)
            try:
                yield
            finally:
                self.set_states(current)  # later forwards continue from where they were

        return contextlib.nullcontext(), recompute()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self._states:
            raise ValueError(f"name: unknown RNG stream {name!r}; known: {sorted(self._states)}")
        saved = _get_rng_state(self.device)
        _set_rng_state(self._states[name], self.device)
        try:
            yield
        finally:
            self._states[name] = _get_rng_state(self.device)
            _set_rng_state(saved, self.device)


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def model_parallel_tracker(seed: int, tp_rank: int, device: torch.device | str | None = None) -> TensorParallelRNGTracker:
    """A tracker whose model-parallel stream is seeded with ``seed + 2718 + tp_rank``.

    Does not touch the default RNG. ``device`` defaults to the current CUDA device when CUDA
    is available, else CPU.
    """
    tracker = TensorParallelRNGTracker(_default_device() if device is None else device)
    tracker.add(MODEL_PARALLEL_RNG, seed + TP_SEED_OFFSET + tp_rank)
    return tracker


def model_parallel_seed(seed: int, tp_rank: int, device: torch.device | str | None = None) -> TensorParallelRNGTracker:
    """Seed the default RNG with ``seed`` (the same on every TP rank; CPU and all CUDA devices)
    and return ``model_parallel_tracker(seed, tp_rank, device)``."""
    torch.manual_seed(seed)
    return model_parallel_tracker(seed, tp_rank, device)
