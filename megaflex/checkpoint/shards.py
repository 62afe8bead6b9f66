"""The saved shards of a megaflex checkpoint as plain fp32 GPT state dicts, one per saved TP rank.

* ZeRO 0: ``mp_rank_XX_model_states.pt["module"]``;
* ZeRO 1-3: the fp32 master weights consolidated over data-parallel ranks with DeepSpeed's
  ``zero_to_fp32`` (run on each TP rank's files separately); frozen parameters, which ZeRO 1
  keeps only in the module state, are taken from there;
* pipeline-parallel checkpoints: read per stage and TP rank and mapped back to the GPT's parameter
  names (``megaflex.parallel.pipeline.gpt_parameter_name``).

``weights`` reshards these to a caller's TP size; ``reshard``'s CLI reads pipeline checkpoints here.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path

import torch

from megaflex.checkpoint.layout import model_states_file, pipeline_layer_files, tp_rank_files, zero_optim_files

StateDict = dict[str, torch.Tensor]


def load_tp_state_dicts(path: Path, tp_size: int, pp_size: int = 1, num_layers: int = 0) -> list[StateDict]:
    """One fp32 state dict per saved TP rank (each that rank's shards, consolidated over ZeRO and,
    with ``pp_size`` > 1, over the pipeline stages of a ``num_layers``-block GPT)."""
    if pp_size > 1:
        return [_pipeline_state_dict(path, tp_size, pp_size, num_layers, tp_rank) for tp_rank in range(tp_size)]
    return [_model_parallel_state_dict(path, tp_rank) for tp_rank in range(tp_size)]


def _model_parallel_state_dict(path: Path, mp_rank: int) -> StateDict:
    """The fp32 weights DeepSpeed saved for model-parallel rank ``mp_rank`` (the TP rank without PP)."""
    model_file = model_states_file(path, mp_rank)  # ZeRO 0-2 (ZeRO 3 writes per-rank model states)
    module = torch.load(model_file, map_location="cpu", weights_only=False)["module"] if model_file.is_file() else None
    if zero_optim_files(path, mp_rank):
        state = _zero_consolidated(path, mp_rank)
        # Frozen parameters (not in the optimizer) are kept by ZeRO 1 only in the module's
        # state dict (ZeRO 2/3 save them as fragments that zero_to_fp32 already merged).
        state.update({k: v for k, v in (module or {}).items() if k not in state and v.numel() > 0})
    elif module is not None:
        state = module
    else:
        raise ValueError(f"checkpoint: {model_file} not found (expected DeepSpeed files for model-parallel rank {mp_rank})")
    return {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}


def _pipeline_state_dict(path: Path, tp_size: int, pp_size: int, num_layers: int, tp_rank: int) -> StateDict:
    """TP rank ``tp_rank``'s GPT state dict gathered over the stages of a pipeline checkpoint (the
    tied embedding, held by the first and the last stage, is one weight: the first stage's)."""
    from megaflex.parallel.pipeline import gpt_parameter_name

    if zero_optim_files(path, tp_rank):  # ZeRO 1: the fp32 masters, per model-parallel rank stage x tp + tp_rank
        named = {}
        for stage in range(pp_size):
            named = _model_parallel_state_dict(path, stage * tp_size + tp_rank) | named
    else:  # ZeRO 0: the engine's own per-layer files, named "<layer index>.<name in the layer>"
        named = {}
        for index, file in pipeline_layer_files(path, tp_rank).items():
            layer = torch.load(file, map_location="cpu", weights_only=False)
            named.update({f"{index}.{k}": v for k, v in layer.items() if f"{index}.{k}" not in named})
        if not named:
            raise ValueError(f"checkpoint: no pipeline layer files for TP rank {tp_rank} in {path}")
    out: StateDict = {}
    for name, value in named.items():
        out.setdefault(gpt_parameter_name(name, num_layers), value.float() if value.is_floating_point() else value)
    return out


def _zero_consolidated(path: Path, tp_rank: int) -> StateDict:  # tp_rank: the model-parallel rank
    """``zero_to_fp32`` over the files of one TP rank (it globs a folder, so give it a view
    holding only that rank's model- and optimizer-state files)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        view = Path(tmp) / "view"
        view.mkdir()
        for f in tp_rank_files(path, tp_rank):
            if f == model_states_file(path, tp_rank):
                states = torch.load(f, map_location="cpu", weights_only=False)
                if states.get("module") is None:  # the pipeline engine keeps the weights in per-layer files
                    torch.save({**states, "module": {}}, view / f.name)  # zero_to_fp32 reads its buffers
                    continue
            os.symlink(f.resolve(), view / f.name)
        with contextlib.redirect_stdout(io.StringIO()):  # zero_to_fp32 prints progress
            return dict(get_fp32_state_dict_from_zero_checkpoint(tmp, tag="view"))
