"""Print a model's dimensions and exact parameter count from a YAML config.

    python -m megaflex.model.summary configs/flexformer_n_247m.yaml

Reads the ``model:`` section of the file (or the whole file when it is a bare mapping of model
fields), builds the GPT on the ``meta`` device (no memory, no init cost, so the 1.3B config is
instant) and counts its parameters; the last line is ``parameters: N``. The count is that of a
single-device model: embeddings are counted at the padded vocabulary size, tied weights once.

    python -m megaflex.model.summary configs/flexformer_n_7b.yaml --memory --tp 8 --pp 1 --zero 3 --world 64

``--memory`` prints instead the per-rank memory plan of that layout (``megaflex.model.memory_plan``:
weights, gradients, optimizer states, activations with and without activation checkpointing) at
the file's ``train.micro_batch_size``, ``data.seq_len``, ``train.precision`` and ``train.loss_chunk_tokens``
(overridable: ``--micro-batch``, ``--seq-len``, ``--precision``, ``--loss-chunk-tokens``; 0 plans the
whole logits); ``--json`` prints it as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import yaml

from megaflex.attention import named_kernel_parameters
from megaflex.model.config import ModelConfig
from megaflex.model.cross_entropy import DEFAULT_LOSS_CHUNK_TOKENS
from megaflex.model.gpt import GPT
from megaflex.model.layers import pad_vocab_size
from megaflex.model.memory_plan import PRECISIONS, memory_plan


def load_model_config(path: str | Path) -> ModelConfig:
    """ModelConfig from the ``model:`` section of a YAML file, or from a bare mapping."""
    with open(path) as f:
        data: Any = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a YAML mapping, got {type(data).__name__}")
    section = data.get("model", data)
    if not isinstance(section, dict):
        raise ValueError(f"{path}: 'model' must be a mapping, got {type(section).__name__}")
    return ModelConfig.from_dict(section)


def build_meta_model(config: ModelConfig) -> GPT:
    """The single-device GPT with parameters on the meta device (shapes only).

    Falls back to a real CPU build for feature maps whose construction needs data (e.g.
    Performer draws its fixed frequencies from per-head seeds at init).
    """
    try:
        with torch.device("meta"):
            return GPT(config)
    except (NotImplementedError, RuntimeError):
        return GPT(config)


def parameter_breakdown(model: GPT) -> dict[str, int]:
    """Parameter count per component (embedding, attention, kernel, mlp, norms, head)."""
    counts: dict[str, int] = defaultdict(int)
    kernel = {name for name, _ in named_kernel_parameters(model)}
    for name, param in model.named_parameters():  # shared (tied) parameters appear once
        if name in kernel:
            group = "attention feature maps"
        elif ".attn." in name:
            group = "attention (qkv, out, gain)"
        elif ".mlp." in name:
            group = "mlp"
        elif "norm" in name:
            group = "norms"
        elif name.startswith("lm_head"):
            group = "lm head (untied)"
        else:
            group = "embeddings"
        counts[group] += param.numel()
    return dict(counts)


def summarize(config: ModelConfig) -> str:
    """Human-readable summary; the last line is ``parameters: N``."""
    model = build_meta_model(config)
    total = model.num_parameters()
    feature_map = model.blocks[0].attn.core.feature_map
    lines = [
        f"attention:        {config.attention}"
        + (f" (normalization={config.normalization}, chunk={config.chunk_size})" if config.is_linear_attention else ""),
        f"layers:           {config.num_layers}",
        f"hidden:           {config.hidden_size}",
        f"heads:            {config.num_heads} x head_dim {config.head_dim}",
        f"ffn:              {config.ffn_hidden_size} ({config.mlp})",
        # The built map's F (elu and cosformer fix it from head_dim, ignoring config.feature_dim).
        f"feature dim:      {feature_map.feature_dim if feature_map is not None else '-'}",
        f"vocab:            {config.vocab_size} (padded {pad_vocab_size(config.vocab_size, 1)}), "
        f"tied embeddings: {config.tie_embeddings}",
        f"positions:        {config.position}, max_seq_len {config.max_seq_len}",
    ]
    for group, count in parameter_breakdown(model).items():
        lines.append(f"  {group:<28s} {count:>14,d}")
    lines.append(f"parameters: {total}")
    return "\n".join(lines)


def training_defaults(path: str | Path) -> dict[str, Any]:
    """micro_batch, seq_len, precision and loss_chunk_tokens from a YAML file's ``train:``/``data:``
    sections (or the trainer's defaults; precision ``auto`` counts as bf16, what it resolves to on GPUs)."""
    with open(path) as f:
        data: Any = yaml.safe_load(f)
    data = data if isinstance(data, dict) else {}
    train, data_section = data.get("train") or {}, data.get("data") or {}
    precision = train.get("precision", "auto")
    return {"micro_batch": int(train.get("micro_batch_size", 1)), "seq_len": int(data_section.get("seq_len", 1024)),
            "precision": "bf16" if precision == "auto" else precision,
            "loss_chunk_tokens": int(train.get("loss_chunk_tokens", DEFAULT_LOSS_CHUNK_TOKENS))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megaflex.model.summary", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="YAML file with a 'model:' section (or a bare model mapping)")
    plan = parser.add_argument_group("memory plan (--memory)")
    plan.add_argument("--memory", action="store_true", help="print the per-rank memory plan instead")
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    plan.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    plan.add_argument("--cp", type=int, default=1, help="context-parallel size")
    plan.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp > 1)")
    plan.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3), help="ZeRO stage")
    plan.add_argument("--world", type=int, default=None, help="ranks in all (default: tp x cp x pp, one replica)")
    plan.add_argument("--micro-batch", type=int, default=None, help="default: the file's train.micro_batch_size")
    plan.add_argument("--seq-len", type=int, default=None, help="default: the file's data.seq_len")
    plan.add_argument("--precision", choices=PRECISIONS, default=None, help="default: the file's train.precision")
    plan.add_argument("--loss-chunk-tokens", type=int, default=None,
                      help="tokens per chunk of the loss, 0: the whole logits (default: the file's train.loss_chunk_tokens)")
    plan.add_argument("--json", action="store_true", help="the plan as JSON (bytes)")
    args = parser.parse_args(argv)
    config = load_model_config(args.config)
    if not (args.memory or args.json):
        print(summarize(config))
        return
    defaults = training_defaults(args.config)
    try:
        result = memory_plan(
            config, tp=args.tp, pp=args.pp, cp=args.cp, sequence_parallel=args.sp, zero=args.zero,
            # `is None`, not `or`: 0 is a value to refuse, not "use the default"
            world=args.tp * args.cp * args.pp if args.world is None else args.world,
            micro_batch=defaults["micro_batch"] if args.micro_batch is None else args.micro_batch,
            seq_len=defaults["seq_len"] if args.seq_len is None else args.seq_len,
            precision=args.precision or defaults["precision"],
            loss_chunk_tokens=defaults["loss_chunk_tokens"] if args.loss_chunk_tokens is None else args.loss_chunk_tokens,
        )
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(result.to_dict(), indent=1) if args.json else result.format())


if __name__ == "__main__":
    main()
