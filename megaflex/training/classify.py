"""``python -m megaflex.training.classify``: train and test an encoder classifier on a Long Range
Arena task (ListOps, Text, Retrieval) with any attention kind.

    python -m data_prep.listops --out work_data/listops            # ListOps, generated locally
    python -m megaflex.training.classify --task listops --data work_data/listops \\
        --attention flexformer_n --out runs/listops_fn

Its own small entry point, not ``megaflex.training.trainer``: the trainer is built around a causal
language model (memory-mapped token streams cut into fixed-length samples, next-token labels, a
perplexity evaluation, DeepSpeed engines). A classifier needs padded variable-length examples with
one label each (or a pair of documents), a pooled cross-entropy and accuracy. What it shares with
the trainer is what decides the numbers: the model (``megaflex.model.encoder``: the GPT's blocks
with ``model.causal: false``), AdamW with decoupled weight decay, linear warm-up and cosine decay.

One process, one device (``--device cpu|cuda``); deterministic for a seed on one machine. Writes
``OUT/result.json`` (config, valid accuracy at each evaluation, test accuracy at the best valid
step, throughput) and prints progress."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from megaflex.data.lra import (
    BYTE_VOCAB_SIZE, LISTOPS_NUM_CLASSES, LISTOPS_VOCAB, ListOpsDataset, RetrievalBytesDataset, TextBytesDataset,
    collate_lra, listops_path,
)
from megaflex.model.config import ModelConfig
from megaflex.model.encoder import POOLINGS, EncoderClassifier
from megaflex.training.optim import decay_factor, param_groups

Dataset = torch.utils.data.Dataset


def _text(data: str, split: str, max_len: int, add_cls: bool) -> Dataset:
    """aclImdb (LRA validates on the test split), or a folder of ``train.jsonl``/``test.jsonl``."""
    split = "test" if split == "valid" else split
    jsonl = Path(data) / f"{split}.jsonl"
    return TextBytesDataset(jsonl if jsonl.is_file() else data, split, max_len=max_len, add_cls=add_cls)


@dataclass(frozen=True)
class Task:
    """An LRA task: its classes, towers (2: a pair of documents), vocabulary, LRA's length, its data."""

    num_classes: int
    towers: int
    vocab_size: int
    max_len: int
    dataset: Callable[[str, str, int, bool], Dataset]  # (data path, split, max_len, add_cls)


TASKS: dict[str, Task] = {
    "listops": Task(LISTOPS_NUM_CLASSES, 1, len(LISTOPS_VOCAB), 2000,
                    lambda data, split, n, cls: ListOpsDataset(listops_path(data, split), max_len=n, add_cls=cls)),
    "text": Task(2, 1, BYTE_VOCAB_SIZE, 4096, _text),
    "retrieval": Task(2, 2, BYTE_VOCAB_SIZE, 4000,
                      lambda data, split, n, cls: RetrievalBytesDataset(data, split, max_len=n, add_cls=cls)),
}  # fmt: skip


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``collate_lra``'s batch as ``EncoderClassifier`` keyword arguments (labels included)."""
    batch = {k: v.to(device) for k, v in batch.items()}
    if "input_ids_1" in batch:  # a pair of documents
        return {"input_ids": batch["input_ids_1"], "attention_mask": batch["attention_mask_1"],
                "pair_ids": batch["input_ids_2"], "pair_mask": batch["attention_mask_2"], "labels": batch["label"]}  # fmt: skip
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": batch["label"]}


@dataclass
class ClassifyConfig:
    """One run: the task, the encoder and its training."""

    task: str = "listops"
    data: str = ""
    out: str = "runs/classify"
    attention: str = "flexformer_n"
    normalization: str = "capped_denominator"
    softmax_window: int = 0
    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    ffn_hidden_size: int = 512
    feature_dim: int = 64
    position: str = "learned"
    pooling: str = "mean"
    max_len: int = 0  # 0: the task's own (LRA's)
    steps: int = 5000
    batch_size: int = 32
    lr: float = 5e-4
    min_lr: float = 0.0
    warmup: int = 500
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 500
    eval_examples: int = 0  # 0: the whole split
    max_train_examples: int = 0  # 0: all
    seed: int = 1234
    device: str = "cpu"
    feature_kwargs: dict[str, Any] = field(default_factory=dict)

    def model_config(self, task: Task, max_len: int) -> ModelConfig:
        return ModelConfig(
            vocab_size=task.vocab_size, num_layers=self.num_layers, hidden_size=self.hidden_size,
            num_heads=self.num_heads, ffn_hidden_size=self.ffn_hidden_size, attention=self.attention,
            feature_dim=self.feature_dim, normalization=self.normalization, softmax_window=self.softmax_window,
            feature_kwargs=dict(self.feature_kwargs), position=self.position, max_seq_len=max_len, causal=False,
        )  # fmt: skip


def lr_at(cfg: ClassifyConfig, step: int) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr`` at ``steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.min_lr + decay_factor("cosine", progress) * (cfg.lr - cfg.min_lr)


@torch.no_grad()
def accuracy(model: EncoderClassifier, examples: Dataset, batch_size: int, device: torch.device) -> float:
    """Fraction of ``examples`` whose argmax logit is the label."""
    model.eval()
    correct = 0
    for start in range(0, len(examples), batch_size):
        inputs = model_inputs(collate_lra([examples[i] for i in range(start, min(len(examples), start + batch_size))]), device)
        labels = inputs.pop("labels")
        correct += int((model(**inputs).logits.argmax(-1) == labels).sum())
    model.train()
    return correct / max(1, len(examples))


def train(cfg: ClassifyConfig, log: Any = print) -> dict[str, Any]:
    """Train, evaluate on valid every ``eval_every`` steps, test the best valid weights; the result dict."""
    if cfg.task not in TASKS:
        raise ValueError(f"task: expected one of {sorted(TASKS)}, got {cfg.task!r}")
    if cfg.pooling not in POOLINGS:
        raise ValueError(f"pooling: expected one of {POOLINGS}, got {cfg.pooling!r}")
    task = TASKS[cfg.task]
    max_len = cfg.max_len or task.max_len
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    splits: dict[str, Dataset] = {
        name: task.dataset(cfg.data, name, max_len, cfg.pooling == "cls") for name in ("train", "valid", "test")
    }
    if cfg.max_train_examples:
        splits["train"] = torch.utils.data.Subset(splits["train"], range(min(cfg.max_train_examples, len(splits["train"]))))
    if cfg.eval_examples:
        splits["valid"] = torch.utils.data.Subset(splits["valid"], range(min(cfg.eval_examples, len(splits["valid"]))))
    log(f"[classify] {cfg.task}: " + ", ".join(f"{k} {len(v)}" for k, v in splits.items()) + f" examples, max_len {max_len}")
    model = EncoderClassifier(cfg.model_config(task, max_len), task.num_classes, cfg.pooling, task.towers).to(device)
    # the trainer's groups: matrices decay; vectors and the kernel's parameters do not
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8)
    order = torch.Generator().manual_seed(cfg.seed)
    train_set, position, permutation = splits["train"], 0, torch.randperm(len(splits["train"]), generator=order)
    history, best = [], (-1.0, 0, None)
    tokens, t0 = 0, time.perf_counter()
    for step in range(cfg.steps):
        if position + cfg.batch_size > len(train_set):  # a new epoch: a new order
            position, permutation = 0, torch.randperm(len(train_set), generator=order)
        batch = collate_lra([train_set[int(i)] for i in permutation[position : position + cfg.batch_size]])
        tokens += int(sum(m.sum() for k, m in batch.items() if k.startswith("attention_mask")))  # host tensors: no sync
        inputs = model_inputs(batch, device)
        position += cfg.batch_size
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, step)
        loss = model(**inputs).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip) if cfg.grad_clip else None
        optimizer.step()
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            valid = accuracy(model, splits["valid"], cfg.batch_size, device)
            elapsed = time.perf_counter() - t0
            history.append({"step": step + 1, "train_loss": float(loss.detach()), "valid_accuracy": valid,
                            "grad_norm": None if grad_norm is None else float(grad_norm), "seconds": elapsed})  # fmt: skip
            log(f"[classify] step {step + 1}/{cfg.steps}: loss {float(loss.detach()):.4f}, valid accuracy {valid:.4f} "
                f"({tokens / elapsed:.0f} tokens/s)")  # fmt: skip
            if valid > best[0]:
                best = (valid, step + 1, {k: v.detach().clone() for k, v in model.state_dict().items()})
    seconds = time.perf_counter() - t0
    model.load_state_dict(best[2])
    test = accuracy(model, splits["test"], cfg.batch_size, device)
    log(f"[classify] test accuracy {test:.4f} at the best valid step {best[1]} (valid {best[0]:.4f})")
    return {
        "config": asdict(cfg), "max_len": max_len, "num_parameters": sum(p.numel() for p in model.parameters()),
        "examples": {k: len(v) for k, v in splits.items()}, "history": history, "best_valid_accuracy": best[0],
        "best_step": best[1], "test_accuracy": test, "train_seconds": seconds, "train_tokens_per_s": tokens / seconds,
        "majority_test_accuracy": _majority(splits["test"]),
    }  # fmt: skip


def _majority(examples: Dataset) -> float:
    """The accuracy of always answering the most frequent label."""
    labels = torch.stack([examples[i]["label"] for i in range(len(examples))])
    return float(labels.bincount().max()) / max(1, len(labels))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megaflex.training.classify", description=__doc__.split("\n\n")[0])
    defaults = ClassifyConfig()
    for f in ClassifyConfig.__dataclass_fields__.values():
        if f.name == "feature_kwargs":
            continue
        flag, default = "--" + f.name.replace("_", "-"), getattr(defaults, f.name)
        p.add_argument(flag, type=type(default), default=default, help=f"default {default!r}")
    p.add_argument("--feature-kwargs", type=json.loads, default={}, help="JSON object of feature-map kwargs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = ClassifyConfig(**vars(args))
    try:
        result = train(cfg)
    except (ValueError, FileNotFoundError) as error:  # bad settings or data: one line, exit 2
        print(f"classify: {error}", file=sys.stderr)
        return 2
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"[classify] wrote {out / 'result.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
