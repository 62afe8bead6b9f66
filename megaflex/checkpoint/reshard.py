"""Exact conversion of model checkpoints between tensor-parallel sizes, and safetensors export.

A *layout* maps every state-dict key to a ``ShardSpec``: replicated, split along one dim, or
vocabulary-padded (split on dim 0 with padding rows at or past ``vocab_size``). It is derived
once from the model itself: ``derive_layout(build)`` builds the model (on the meta device when
it can) at TP=1 and at a small TP>1 (parallelised over a group-less ``ParallelState.detached``) and compares
shapes, so every sharded tensor is found (column/row weights, feature-map Omega/tau,
per-head gains, buffers) without a hand-written name list; vocabulary tensors are recognised
by their ``true_vocab_size`` tag.

Resharding TP=a -> TP=b concatenates the a shards along each split dim and cuts the result into
b. Vocabulary tensors keep every row that the new padded size has room for (only padding rows
are ever dropped, extra padding rows are zero), so TP=1 -> 2 -> 4 -> 1 is bit-exact.

CLI (model weights of a megaflex/DeepSpeed checkpoint tag; optimizer states are not resharded)::

    python -m megaflex.checkpoint.reshard CKPT/step_00001000 OUT_DIR --tp 2
    python -m megaflex.checkpoint.reshard CKPT/step_00001000 OUT_DIR --safetensors   # TP=1 export

A pipeline-parallel checkpoint is read through ``megaflex.checkpoint.weights`` (its stages gathered
into plain GPT state dicts); the output is always a plain TP checkpoint (no pipeline stages).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from megaflex.checkpoint.layout import META_FILE, MODEL_STATES, model_states_file, verify_checkpoint, write_meta
from megaflex.cli_args import existing_dir, positive_int
from megaflex.checkpoint.metadata import CheckpointMeta
from megaflex.checkpoint.shards import load_tp_state_dicts
from megaflex.model.config import ModelConfig
from megaflex.model.gpt import GPT
from megaflex.model.layers import pad_vocab_size
from megaflex.parallel.layers import TensorParallelLayers
from megaflex.parallel.parallelize import parallelize_with
from megaflex.parallel.random import TensorParallelRNGTracker
from megaflex.parallel.state import ParallelState

StateDict = dict[str, Any]
SAFETENSORS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class ShardSpec:
    """How one state-dict entry is laid out over TP ranks."""

    partition_dim: int | None = None  # None: replicated (identical on every rank)
    vocab_size: int | None = None  # set for vocabulary-padded tensors (partition_dim 0)


Layout = dict[str, ShardSpec]


# ------------------------------------------------------------------------------- layout
def _entries(model: nn.Module) -> dict[str, Any]:
    # keep_vars: the Parameter objects themselves, so their partition tags are visible.
    return model.state_dict(keep_vars=True)


def _skeleton(build: Callable[[ParallelState], nn.Module], state: ParallelState) -> dict[str, Any]:
    """State-dict entries of ``build(state)``, built on the meta device when the model allows
    it (no memory, no compute) and on CPU otherwise (e.g. a feature map that draws frequencies
    from a seeded generator at construction). The default RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                return _entries(build(state))
        except (NotImplementedError, RuntimeError):
            return _entries(build(state))


def derive_layout(build: Callable[[ParallelState], nn.Module], probe_tp: int = 2) -> Layout:
    """Layout of the model ``build(state)`` builds, from skeletons at TP=1 and TP=``probe_tp``.

    ``build`` must build the same architecture parallelised over any (group-less) state (e.g.
    ``gpt_layout``'s); ``probe_tp`` must divide its sharded dims.
    """
    full, shard = _skeleton(build, ParallelState.single()), _skeleton(build, ParallelState.detached(probe_tp, 0))
    if full.keys() != shard.keys():
        raise ValueError(f"build: TP=1 and TP={probe_tp} models have different entries: "
                         f"{sorted(set(full) ^ set(shard))}")
    layout: Layout = {}
    for name, tensor in full.items():
        local = shard[name]
        if not isinstance(tensor, torch.Tensor):
            layout[name] = ShardSpec()
            continue
        vocab = getattr(local, "true_vocab_size", None)
        if vocab is not None:
            layout[name] = ShardSpec(0, int(vocab))
            continue
        diff = [d for d, (a, b) in enumerate(zip(tensor.shape, local.shape)) if a != b]
        if tensor.dim() != local.dim() or len(diff) > 1 or (diff and tensor.shape[diff[0]] != probe_tp * local.shape[diff[0]]):
            raise ValueError(f"{name}: cannot infer its TP layout from shapes {tuple(tensor.shape)} (TP=1) and "
                             f"{tuple(local.shape)} (TP={probe_tp})")
        tagged = getattr(local, "partition_dim", None) if getattr(local, "tensor_model_parallel", False) else None
        if probe_tp == 1:  # shapes cannot tell: trust the tags
            layout[name] = ShardSpec(tagged)
            continue
        dim = diff[0] if diff else None
        if tagged is not None and tagged != dim:
            raise ValueError(f"{name}: tagged partition_dim={tagged} but its shapes differ on dim {dim}")
        layout[name] = ShardSpec(dim)
    return layout


def gpt_layout(config: ModelConfig) -> Layout:
    """Layout of ``megaflex.model.GPT(config)``."""
    def build(state: ParallelState) -> GPT:
        # Through the TP layers also at TP=1: a one-head model's layout comes from their tags.
        # A throwaway tracker: building must not depend on any RNG stream.
        return parallelize_with(GPT(config), TensorParallelLayers(state, TensorParallelRNGTracker("cpu")), config)

    return derive_layout(build, probe_tp=_probe_tp(config))


def _probe_tp(config: ModelConfig) -> int:
    # The smallest TP size >= 2 the config can be built with (its heads and MLP must divide).
    # None (e.g. one head): the model only exists at TP=1, where only the vocab padding matters.
    for tp in range(2, config.num_heads + 1):
        if config.num_heads % tp == 0 and config.ffn_hidden_size % tp == 0:
            return tp
    return 1


# ------------------------------------------------------------------------------- merge / split
def merge_shards(shards: Sequence[Mapping[str, Any]], layout: Layout) -> StateDict:
    """Per-rank state dicts of a TP=len(shards) model -> the TP=1 state dict."""
    return _resize_vocab(_concat(shards, layout), layout, 1)


def split_state_dict(full: Mapping[str, Any], layout: Layout, tp_size: int) -> list[StateDict]:
    """TP=1 state dict (any vocab padding) -> ``tp_size`` per-rank state dicts."""
    _check_keys(full, layout, "full state dict")
    padded = _resize_vocab(dict(full), layout, tp_size)
    out: list[StateDict] = [{} for _ in range(tp_size)]
    for name, value in padded.items():
        dim = layout[name].partition_dim
        if dim is None:
            for rank_sd in out:
                rank_sd[name] = value.clone() if isinstance(value, torch.Tensor) else value
            continue
        if value.shape[dim] % tp_size != 0:
            raise ValueError(f"{name}: dim {dim} of size {value.shape[dim]} cannot be split over tp_size={tp_size}")
        for rank, part in enumerate(value.chunk(tp_size, dim=dim)):
            out[rank][name] = part.clone()
    return out


def reshard(shards: Sequence[Mapping[str, Any]], layout: Layout, tp_size: int) -> list[StateDict]:
    """Per-rank state dicts at TP=len(shards) -> per-rank state dicts at TP=``tp_size``."""
    if tp_size < 1:
        raise ValueError(f"tp_size: expected >= 1, got {tp_size}")
    return split_state_dict(_concat(shards, layout), layout, tp_size)


def _check_keys(sd: Mapping[str, Any], layout: Layout, what: str) -> None:
    missing, extra = sorted(set(layout) - set(sd)), sorted(set(sd) - set(layout))
    if missing or extra:
        raise ValueError(f"{what}: keys do not match the layout; missing {missing}, unexpected {extra}")


def _concat(shards: Sequence[Mapping[str, Any]], layout: Layout) -> StateDict:
    if not shards:
        raise ValueError("shards: expected at least one per-rank state dict, got none")
    for rank, sd in enumerate(shards):
        _check_keys(sd, layout, f"shards[{rank}]")
    merged: StateDict = {}
    for name, spec in layout.items():
        parts = [sd[name] for sd in shards]
        if spec.partition_dim is None:
            merged[name] = parts[0]  # replicated: every rank holds the same tensor
            continue
        shapes = {tuple(p.shape) for p in parts}
        if len(shapes) != 1:
            raise ValueError(f"{name}: shards have different shapes {sorted(shapes)}")
        merged[name] = torch.cat(parts, dim=spec.partition_dim)
    return merged


def _resize_vocab(sd: StateDict, layout: Layout, tp_size: int) -> StateDict:
    """Pad/trim vocabulary tensors to ``pad_vocab_size(vocab, tp_size)`` rows (only padding rows go)."""
    for name, spec in layout.items():
        if spec.vocab_size is None:
            continue
        value, rows = sd[name], pad_vocab_size(spec.vocab_size, tp_size)
        if value.shape[0] < spec.vocab_size:
            raise ValueError(f"{name}: expected at least vocab_size={spec.vocab_size} rows, got {value.shape[0]}")
        if value.shape[0] >= rows:
            sd[name] = value[:rows]
        else:
            extra = value.new_zeros((rows - value.shape[0], *value.shape[1:]))
            sd[name] = torch.cat([value, extra], dim=0)
    return sd


# ------------------------------------------------------------------------------- loading / export
def load_state_dict_checked(model: nn.Module, state_dict: Mapping[str, Any]) -> None:
    """``model.load_state_dict(state_dict)`` with ValueErrors naming the entry and both shapes."""
    expected = model.state_dict()
    _check_keys(state_dict, {k: ShardSpec() for k in expected}, "state_dict")
    for name, target in expected.items():
        value = state_dict[name]
        if isinstance(target, torch.Tensor) and tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} does not match the model's {tuple(target.shape)}")
    model.load_state_dict(state_dict)


def _config_dict(config: Any) -> dict[str, Any]:
    if hasattr(config, "to_dict"):
        return config.to_dict()
    if is_dataclass(config):
        return asdict(config)
    return dict(config)


def export_safetensors(state_dict: Mapping[str, torch.Tensor], config: Any, out_dir: str | Path) -> Path:
    """Write a TP=1 state dict to ``out_dir/model.safetensors`` with ``config.json`` beside it."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # safetensors refuses shared storage (e.g. tied weights) and non-contiguous views: copy.
    tensors = {name: t.detach().contiguous().clone() for name, t in state_dict.items()}
    save_file(tensors, str(out / SAFETENSORS_FILE), metadata={"format": "pt", "tensor_parallel_size": "1"})
    (out / CONFIG_FILE).write_text(json.dumps(_config_dict(config), indent=1) + "\n")
    return out / SAFETENSORS_FILE


# ------------------------------------------------------------------------------- CLI
def _read_checkpoint(tag_dir: Path) -> tuple[list[StateDict], CheckpointMeta]:
    meta = CheckpointMeta.from_dict(verify_checkpoint(tag_dir))  # names a damaged file before torch reads it
    tp = int(meta.tensor_parallel_size)
    if meta.pp_size > 1:  # per-stage files: gathered into GPT state dicts, one per TP rank
        num_layers = ModelConfig.from_dict(meta.model_config).num_layers
        return load_tp_state_dicts(tag_dir, tp, meta.pp_size, num_layers), meta
    shards = []
    for rank in range(tp):
        blob = torch.load(model_states_file(tag_dir, rank), map_location="cpu", weights_only=False)
        shards.append(blob["module"] if "module" in blob else blob)
    return shards, meta


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=existing_dir, help=f"a checkpoint tag folder (with {META_FILE} and model-states files)")
    parser.add_argument("output", type=Path)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--tp", type=positive_int, help=f"target tensor-parallel size (writes {MODEL_STATES.format(0)}, ...)")
    group.add_argument("--safetensors", action="store_true", help="export TP=1 model.safetensors + config.json")
    args = parser.parse_args(argv)

    shards, meta = _read_checkpoint(args.checkpoint)
    config = ModelConfig.from_dict(meta.model_config)
    layout = gpt_layout(config)
    if args.safetensors:
        path = export_safetensors(merge_shards(shards, layout), config, args.output)
        print(f"wrote {path} (TP={len(shards)} -> 1)")
        return
    args.output.mkdir(parents=True, exist_ok=True)
    new_shards = reshard(shards, layout, args.tp)
    for rank, sd in enumerate(new_shards):
        torch.save({"module": sd}, model_states_file(args.output, rank))
    meta.tensor_parallel_size, meta.resharded_from, meta.files = args.tp, len(shards), None
    meta.pipeline_parallel_size = None  # the output holds plain (non-pipeline) model-states files
    if meta.parameter_shapes is not None:  # per-rank shapes, as the trainer records and checks them
        meta.parameter_shapes = {k: list(new_shards[0][k].shape) for k in meta.parameter_shapes}
    write_meta(args.output, meta.to_dict())  # checksums of the new shards
    print(f"wrote {args.tp} model shards to {args.output} (TP={len(shards)} -> {args.tp}; weights only)")


if __name__ == "__main__":
    main()
