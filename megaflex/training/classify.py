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

``--data`` is the folder of the task's three splits (``Task.layout``); one file is refused, never
used as train, valid and test at once. Text has no validation split of its own: without a
``valid.jsonl`` it selects the best step on the test split (LRA's protocol), and says so.

One process, one device (``--device cpu|cuda``); deterministic for a seed on one machine. Every
argument is checked while parsing (``--out`` is created then), before any data is read. Prints the
examples and truncated rows per split, progress with an ETA every ``--log-interval`` steps, and
writes ``OUT/result.json`` (config, valid accuracy at each evaluation, test accuracy at the best
valid step, the split it was selected on, throughput). Ctrl-C writes what the run has
(``"partial": true``, the step reached, no test accuracy) and exits 130."""

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

from megaflex.attention import ATTENTION_KINDS, NORMALIZATIONS
from megaflex.cli_args import (
    available_device, nonnegative_float, nonnegative_int, positive_float, positive_int, writable_dir,
)
from megaflex.data.lra import (
    BYTE_VOCAB_SIZE, LISTOPS_NUM_CLASSES, LISTOPS_VOCAB, ListOpsDataset, LRAFormatError, RetrievalBytesDataset,
    TextBytesDataset, aan_path, collate_lra, listops_path, text_path,
)
from megaflex.model.config import POSITION_KINDS, ModelConfig
from megaflex.model.encoder import POOLINGS, EncoderClassifier
from megaflex.training.metrics import hms
from megaflex.training.optim import param_groups, warmup_decay_lr

Dataset = torch.utils.data.Dataset
SPLITS = ("train", "valid", "test")
INTERRUPTED = 130  # 128 + SIGINT, the shell's status for a process ended by Ctrl-C


@dataclass(frozen=True)
class Task:
    """An LRA task: its classes, towers (2: a pair of documents), vocabulary, LRA's length, the files
    its ``--data`` folder holds, and its data."""

    num_classes: int
    towers: int
    vocab_size: int
    max_len: int
    layout: str
    dataset: Callable[[str, str, int, bool], Dataset]  # (data folder, split, max_len, add_cls)


TASKS: dict[str, Task] = {
    "listops": Task(LISTOPS_NUM_CLASSES, 1, len(LISTOPS_VOCAB), 2000, "basic_{train,val,test}.tsv",
                    lambda data, split, n, cls: ListOpsDataset(listops_path(data, split), max_len=n, add_cls=cls)),
    "text": Task(2, 1, BYTE_VOCAB_SIZE, 4096, "train.jsonl and test.jsonl (+ valid.jsonl), or aclImdb's train/ and test/",
                 lambda data, split, n, cls: TextBytesDataset(*text_path(data, split), max_len=n, add_cls=cls)),
    "retrieval": Task(2, 2, BYTE_VOCAB_SIZE, 4000, "new_aan_pairs.{train,eval,test}.tsv",
                      lambda data, split, n, cls: RetrievalBytesDataset(aan_path(data, split), split, max_len=n, add_cls=cls)),
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
    log_interval: int = 50  # progress line (loss, lr, tokens/s, ETA) every this many steps, as logging.log_interval
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


class ClassifyInterrupted(KeyboardInterrupt):
    """Ctrl-C after the data was loaded: ``result`` is what the run had (``partial``, ``step``)."""

    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__(f"interrupted at step {result['step']}")
        self.result = result


def lr_at(cfg: ClassifyConfig, step: int) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr`` at ``steps``."""
    return warmup_decay_lr(step, cfg.lr, cfg.min_lr, cfg.warmup, cfg.warmup, cfg.steps, "cosine")


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


def _same_file(a: str, b: str) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def load_splits(cfg: ClassifyConfig, task: Task, max_len: int, log: Callable[[str], None]) -> tuple[dict[str, Dataset], dict[str, Any]]:
    """The three splits of ``cfg.data`` (subsets as configured) and what the result records of them:
    the file each reads, the rows each truncates at ``max_len``, the split the best step is selected on.
    A split never silently stands in for another: one file as ``--data`` and a training file that is
    also the valid or test file are refused; valid = test (Text without valid.jsonl) is said."""
    root = Path(cfg.data)
    if root.exists() and not root.is_dir():
        raise LRAFormatError(f"--data {cfg.data}: expected the folder of the {cfg.task} splits ({task.layout}), got "
                             "a file; one file would serve as train, valid and test")  # fmt: skip
    splits = {name: task.dataset(cfg.data, name, max_len, cfg.pooling == "cls") for name in SPLITS}
    files = {name: ds.source for name, ds in splits.items()}
    for other in ("valid", "test"):
        if _same_file(files["train"], files[other]):
            raise LRAFormatError(f"--data {cfg.data}: the {other} split is the training file {files['train']}; "
                                 "give each split its own file")  # fmt: skip
    truncated = {name: ds.num_truncated for name, ds in splits.items()}
    rows = {name: len(ds) for name, ds in splits.items()}
    selected_on = "test" if _same_file(files["valid"], files["test"]) else "valid"
    if cfg.max_train_examples:
        splits["train"] = torch.utils.data.Subset(splits["train"], range(min(cfg.max_train_examples, len(splits["train"]))))
    if cfg.eval_examples:
        splits["valid"] = torch.utils.data.Subset(splits["valid"], range(min(cfg.eval_examples, len(splits["valid"]))))
    log(f"[classify] {cfg.task}: " + ", ".join(f"{k} {len(v)}" for k, v in splits.items()) + f" examples, max_len {max_len}")
    log(f"[classify] rows longer than max_len {max_len}, truncated (their ends dropped): "
        + ", ".join(f"{k} {n} of {rows[k]}" for k, n in truncated.items()))
    if selected_on == "test":
        log(f"[classify] the best step is selected on the TEST split ({files['test']}): this task has no validation "
            "split here (LRA's protocol for Text), so the test accuracy is not held out; add valid.jsonl to select on one")  # fmt: skip
    else:
        log(f"[classify] the best step is selected on the valid split ({files['valid']})")
    return splits, {"files": files, "truncated": truncated, "selected_on": selected_on}


def train(cfg: ClassifyConfig, log: Callable[[str], None] = lambda line: print(line, flush=True)) -> dict[str, Any]:
    """Train, evaluate on valid every ``eval_every`` steps, test the best valid weights; the result dict.
    Ctrl-C (KeyboardInterrupt) after the data is loaded raises ``ClassifyInterrupted`` with the partial result."""
    if cfg.task not in TASKS:
        raise ValueError(f"task: expected one of {sorted(TASKS)}, got {cfg.task!r}")
    if cfg.pooling not in POOLINGS:
        raise ValueError(f"pooling: expected one of {POOLINGS}, got {cfg.pooling!r}")
    task = TASKS[cfg.task]
    max_len = cfg.max_len or task.max_len
    model_config = cfg.model_config(task, max_len)  # a bad model setting fails before any data is read
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    splits, about = load_splits(cfg, task, max_len, log)
    model = EncoderClassifier(model_config, task.num_classes, cfg.pooling, task.towers).to(device)
    # the trainer's groups: matrices decay; vectors and the kernel's parameters do not
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8)
    order = torch.Generator().manual_seed(cfg.seed)
    train_set, position, permutation = splits["train"], 0, torch.randperm(len(splits["train"]), generator=order)
    history, best = [], (-1.0, 0, None)
    tokens, done, t0 = 0, 0, time.perf_counter()

    def result(test: float | None) -> dict[str, Any]:
        seconds = time.perf_counter() - t0
        return {
            "config": asdict(cfg), "max_len": max_len, "num_parameters": sum(p.numel() for p in model.parameters()),
            "examples": {k: len(v) for k, v in splits.items()}, "truncated": about["truncated"], "files": about["files"],
            "selected_on": about["selected_on"], "history": history,
            "best_valid_accuracy": best[0] if best[1] else None, "best_step": best[1] or None, "test_accuracy": test,
            "partial": test is None, "step": done, "train_seconds": seconds, "train_tokens_per_s": tokens / seconds,
            "majority_test_accuracy": _majority(splits["test"]),
        }  # fmt: skip

    try:
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
            done = step + 1
            elapsed = time.perf_counter() - t0
            progress = f"{tokens / elapsed:,.0f} tokens/s, ETA {hms((cfg.steps - done) * elapsed / done)}"
            if done % cfg.log_interval == 0:
                log(f"[classify] step {done}/{cfg.steps}: loss {float(loss.detach()):.4f}, lr {lr_at(cfg, step):.2e}, {progress}")
            if done % cfg.eval_every == 0 or done == cfg.steps:
                valid = accuracy(model, splits["valid"], cfg.batch_size, device)
                history.append({"step": done, "train_loss": float(loss.detach()), "valid_accuracy": valid,
                                "grad_norm": None if grad_norm is None else float(grad_norm), "seconds": elapsed})  # fmt: skip
                log(f"[classify] step {done}/{cfg.steps}: {about['selected_on']} accuracy {valid:.4f} ({progress})")
                if valid > best[0]:
                    best = (valid, done, {k: v.detach().clone() for k, v in model.state_dict().items()})
        model.load_state_dict(best[2])
        test = accuracy(model, splits["test"], cfg.batch_size, device)
    except KeyboardInterrupt:
        raise ClassifyInterrupted(result(None)) from None
    log(f"[classify] test accuracy {test:.4f} at the best step {best[1]}, selected on {about['selected_on']} "
        f"({best[0]:.4f})")  # fmt: skip
    return result(test)


def _majority(examples: Dataset) -> float:
    """The accuracy of always answering the most frequent label."""
    labels = torch.stack([examples[i]["label"] for i in range(len(examples))])
    return float(labels.bincount().max()) / max(1, len(labels))


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


# what each option accepts, checked while parsing (a count >= 1, a finite learning rate, ...); the
# benchmarks built on classify (benchmarks.lra_listops) type their flags with these too
OPTION_TYPES: dict[str, Callable[[str], Any]] = {
    "out": writable_dir, "device": available_device, "seed": int,
    **dict.fromkeys(("softmax_window", "max_len", "warmup", "eval_examples", "max_train_examples"), nonnegative_int),
    **dict.fromkeys(("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "feature_dim", "steps", "batch_size",
                     "eval_every", "log_interval"), positive_int),
    "lr": positive_float, **dict.fromkeys(("min_lr", "weight_decay", "grad_clip"), nonnegative_float),
}  # fmt: skip
OPTION_CHOICES = {"task": tuple(TASKS), "attention": ATTENTION_KINDS, "normalization": NORMALIZATIONS,
                  "position": POSITION_KINDS, "pooling": POOLINGS}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megaflex.training.classify", description=__doc__.split("\n\n")[0])
    defaults = ClassifyConfig()
    for f in ClassifyConfig.__dataclass_fields__.values():
        if f.name == "feature_kwargs":
            continue
        flag, default = "--" + f.name.replace("_", "-"), getattr(defaults, f.name)
        p.add_argument(flag, type=OPTION_TYPES.get(f.name, type(default)), choices=OPTION_CHOICES.get(f.name), default=default,
                       help=f"default {default!r}")  # fmt: skip
    p.add_argument("--feature-kwargs", type=_json_object, default={}, help="JSON object of feature-map kwargs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = ClassifyConfig(**{**vars(args), "out": str(args.out)})
    path = Path(cfg.out) / "result.json"
    try:
        result = train(cfg)
    except ClassifyInterrupted as stop:
        path.write_text(json.dumps(stop.result, indent=1) + "\n")
        print(f"classify: interrupted at step {stop.result['step']} of {cfg.steps}; partial results (no test accuracy) "
              f"in {path}; exit {INTERRUPTED}", file=sys.stderr)  # fmt: skip
        return INTERRUPTED
    except KeyboardInterrupt:
        print(f"classify: interrupted before the first step, nothing written; exit {INTERRUPTED}", file=sys.stderr)
        return INTERRUPTED
    except (ValueError, FileNotFoundError) as error:  # bad settings or data: one line, exit 2
        print(f"classify: error: {error}", file=sys.stderr)
        return 2
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"[classify] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
