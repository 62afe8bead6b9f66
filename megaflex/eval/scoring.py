"""Exact token accounting for perplexity: non-overlapping windows, sliding windows, stateful.

Definitions (what is counted, identical in every mode):

* The eval set is a list of **documents**, each a 1-D tensor of token ids. A document of T
  tokens has T - 1 **targets**: token t + 1 is predicted from tokens[: t + 1] (or from the
  window / carried state ending at t). The first token of a document is never a target, so a
  tokenizer that prepends BOS/EOD makes every real token a target.
* Every target is scored exactly once. ``ppl = exp(sum NLL / targets)`` with NLL in nats,
  summed in float64, i.e. the token-level perplexity published WikiText tables use.
* ``bits_per_byte = sum NLL / (ln 2 * bytes)`` where ``bytes`` is the UTF-8 length of the
  target tokens (a per-token lookup table ``token_bytes[V]``; special tokens count 0 bytes),
  which makes models with different tokenizers comparable.
* ``context`` of a target is how many tokens the model saw when predicting it (its position
  within the window, or its position in the document for the stateful mode); NLL is also
  accumulated into power-of-two context buckets for ppl-vs-context curves.

Modes:

* ``windows``: documents cut into disjoint windows of ``context`` inputs; each window starts
  from an empty context (cheap, pessimistic: early tokens of a window see little context).
* ``sliding``: windows of ``context`` inputs advanced by ``stride``; only the targets not
  scored by the previous window are scored (Hugging Face's perplexity recipe). With
  ``stride == context`` it is exactly ``windows``.
* ``stateful``: each document is fed in chunks of ``context`` tokens while every layer's
  recurrent state (or KV cache) is carried, so every target sees the whole document prefix at
  linear cost. The result equals one full-length forward and does not depend on ``context``.

Work is split over data-parallel ranks (windows or whole documents, deterministically) and the
float64 sums are all-reduced, so 1, 2 or 4 ranks give the same numbers up to summation order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from megaflex.parallel import comm

MODES = ("windows", "sliding", "stateful")
NUM_BUCKETS = 24  # context buckets (2^(b-1), 2^b]; bucket 23 reaches 4M tokens, enough


@dataclass
class EvalResult:
    """Summed NLL and counts; add two results to merge them (e.g. across documents or ranks)."""

    nll_sum: float = 0.0  # nats, summed in float64
    tokens: int = 0  # scored targets
    bytes: int = 0  # UTF-8 bytes of scored targets (0 when no byte table was given)
    bucket_nll: list[float] = field(default_factory=lambda: [0.0] * NUM_BUCKETS)
    bucket_tokens: list[int] = field(default_factory=lambda: [0] * NUM_BUCKETS)

    def __add__(self, other: "EvalResult") -> "EvalResult":
        return EvalResult(
            self.nll_sum + other.nll_sum,
            self.tokens + other.tokens,
            self.bytes + other.bytes,
            [a + b for a, b in zip(self.bucket_nll, other.bucket_nll)],
            [a + b for a, b in zip(self.bucket_tokens, other.bucket_tokens)],
        )

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.tokens if self.tokens else float("nan")

    @property
    def ppl(self) -> float:
        return math.exp(self.mean_nll) if self.tokens else float("nan")

    @property
    def bits_per_byte(self) -> float | None:
        return self.nll_sum / (math.log(2) * self.bytes) if self.bytes else None

    def by_context(self) -> list[dict[str, float]]:
        """Perplexity of the targets whose context lies in (2^(b-1), 2^b], for non-empty buckets."""
        rows = []
        for b, (nll, n) in enumerate(zip(self.bucket_nll, self.bucket_tokens)):
            if n:
                rows.append({"context_max": 2**b, "tokens": n, "ppl": math.exp(nll / n)})
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "ppl": self.ppl,
            "tokens": self.tokens,
            "bits_per_byte": self.bits_per_byte,
            "bytes": self.bytes,
            "mean_nll": self.mean_nll,
            "by_context": self.by_context(),
        }


@dataclass(frozen=True)
class Window:
    """Inputs ``doc[begin:end]`` predicting ``doc[begin+1:end+1]``; targets ``t >= score_from``
    (absolute indices into the document's target axis) are scored."""

    doc: int
    begin: int
    end: int
    score_from: int


# --- planning: which targets each window scores ------------------------------------------------


def plan_windows(doc_lengths: Sequence[int], context: int, stride: int | None = None) -> list[Window]:
    """Windows covering every target of every document exactly once.

    ``stride=None`` (or ``stride == context``) gives disjoint windows; a smaller stride gives
    overlapping windows where each scores only its new targets.
    """
    _check_positive("context", context)
    stride = context if stride is None else stride
    _check_positive("stride", stride)
    if stride > context:
        raise ValueError(f"stride: expected <= context ({context}) so no target is skipped, got {stride}")
    windows = []
    for d, length in enumerate(doc_lengths):
        num_targets = length - 1
        prev_end = 0
        begin = 0
        while prev_end < num_targets:
            end = min(begin + context, num_targets)
            windows.append(Window(d, begin, end, max(prev_end, begin)))
            prev_end = end
            begin += stride
    return windows


def shard(num_items: int, weights: Sequence[int], rank: int, world_size: int) -> list[int]:
    """Deterministic balanced assignment of items to ranks (greedy longest-first); this rank's items."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size ({world_size}), got {rank}")
    load = [0] * world_size
    mine = []
    for i in sorted(range(num_items), key=lambda i: (-weights[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        load[r] += weights[i]
        if r == rank:
            mine.append(i)
    return sorted(mine)


# --- the model call -----------------------------------------------------------------------------


@torch.no_grad()
def _forward_nll(
    model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, state: Any = None, return_state: bool = False
) -> tuple[torch.Tensor, Any]:
    """NLL [B, N] (fp32, nats) of ``targets`` [B, N] given ``inputs`` [B, N] (and a carried state).

    The one place that knows the model's forward contract, so TP models (vocab-parallel
    cross-entropy) work unchanged: logits are never gathered.
    """
    out = model(inputs, labels=targets, state=state, return_state=return_state)
    return out.per_token_loss.float(), (out.state if return_state else None)


def _accumulate(result: EvalResult, nll: torch.Tensor, targets: torch.Tensor, contexts: torch.Tensor,
                mask: torch.Tensor, token_bytes: torch.Tensor | None) -> None:
    """Add the NLL [B, L] of targets [B, L] seen with ``contexts`` [B, L] tokens where ``mask``."""
    nll = nll.detach().double().cpu()[mask]
    targets, contexts = targets.cpu()[mask], contexts[mask]
    result.nll_sum += nll.sum().item()
    result.tokens += nll.numel()
    if token_bytes is not None:
        result.bytes += int(token_bytes[targets].sum().item())
    buckets = torch.ceil(torch.log2(contexts.double())).long().clamp_(0, NUM_BUCKETS - 1)
    bucket_nll = torch.zeros(NUM_BUCKETS, dtype=torch.float64).index_add_(0, buckets, nll)
    bucket_n = torch.bincount(buckets, minlength=NUM_BUCKETS)
    result.bucket_nll = [a + b for a, b in zip(result.bucket_nll, bucket_nll.tolist())]
    result.bucket_tokens = [a + b for a, b in zip(result.bucket_tokens, bucket_n.tolist())]


# --- the three modes ----------------------------------------------------------------------------


def evaluate_windows(
    model: torch.nn.Module,
    docs: Sequence[torch.Tensor],
    context: int,
    stride: int | None = None,
    *,
    batch_size: int = 8,
    token_bytes: torch.Tensor | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> EvalResult:
    """``windows`` (stride None) or ``sliding`` evaluation of this rank's share of the windows
    (not reduced; ``evaluate`` reduces). Windows of equal length are batched together (no padding, so a model
    whose forward depends on the sequence length is still evaluated exactly)."""
    device = _device_of(model)
    plan = plan_windows([len(d) for d in docs], context, stride)
    mine = [plan[i] for i in shard(len(plan), [w.end - w.begin for w in plan], rank, world_size)]
    result = EvalResult()
    by_length: dict[int, list[Window]] = {}
    for w in mine:
        by_length.setdefault(w.end - w.begin, []).append(w)
    for length, group_windows in sorted(by_length.items()):
        for i in range(0, len(group_windows), batch_size):
            batch = group_windows[i : i + batch_size]
            inputs = torch.stack([docs[w.doc][w.begin : w.end] for w in batch]).to(device)
            targets = torch.stack([docs[w.doc][w.begin + 1 : w.end + 1] for w in batch]).to(device)
            nll, _ = _forward_nll(model, inputs, targets)  # [b, length]
            ctx = torch.arange(1, length + 1).expand(len(batch), -1)  # tokens visible to target t: t - begin + 1
            skip = torch.tensor([[w.score_from - w.begin] for w in batch])  # [b, 1]
            _accumulate(result, nll, targets, ctx, ctx > skip, token_bytes)
    return result


def evaluate_stateful(
    model: torch.nn.Module,
    docs: Sequence[torch.Tensor],
    context: int,
    *,
    batch_size: int = 8,
    token_bytes: torch.Tensor | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> EvalResult:
    """Stateful evaluation of this rank's share of the documents (not reduced): chunks of ``context`` tokens with the recurrent state carried.

    Documents are batched by right-padding to the longest one in the batch; because the model
    is causal, padding only follows a document's own tokens and never changes its scores.
    Documents are sorted by length so batches pad little.
    """
    _check_positive("context", context)
    device = _device_of(model)
    mine = shard(len(docs), [len(d) for d in docs], rank, world_size)
    mine = sorted((i for i in mine if len(docs[i]) > 1), key=lambda i: (-len(docs[i]), i))
    result = EvalResult()
    for i in range(0, len(mine), batch_size):
        batch = [docs[d] for d in mine[i : i + batch_size]]
        num_targets = [len(d) - 1 for d in batch]
        longest = max(num_targets)
        padded = torch.zeros(len(batch), longest + 1, dtype=torch.long)
        for row, d in enumerate(batch):
            padded[row, : len(d)] = d
        padded = padded.to(device)
        state = None
        for begin in range(0, longest, context):
            end = min(begin + context, longest)
            nll, state = _forward_nll(model, padded[:, begin:end], padded[:, begin + 1 : end + 1], state, True)
            ctx = torch.arange(begin + 1, end + 1).expand(len(batch), -1)  # target t sees t + 1 tokens
            real = ctx <= torch.tensor(num_targets)[:, None]  # not padding
            _accumulate(result, nll, padded[:, begin + 1 : end + 1], ctx, real, token_bytes)
    return result


def evaluate(
    model: torch.nn.Module,
    docs: Sequence[torch.Tensor],
    mode: str,
    context: int,
    stride: int | None = None,
    *,
    batch_size: int = 8,
    token_bytes: torch.Tensor | None = None,
    rank: int = 0,
    world_size: int = 1,
    group: Any = None,
) -> EvalResult:
    """Evaluate ``docs`` in ``mode`` (see the module docstring for what each counts).

    With ``world_size > 1`` this rank scores its share and the sums are all-reduced over
    ``group`` (the data-parallel group; every tensor-parallel rank of a replica passes the same
    ``rank``, its data-parallel rank). ``sliding`` defaults to ``stride = context // 2``.
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if mode == "windows" and stride is not None and stride != context:
        raise ValueError(f"stride: the 'windows' mode has stride = context ({context}), got {stride}")
    common = dict(batch_size=batch_size, token_bytes=token_bytes, rank=rank, world_size=world_size)
    was_training = model.training
    model.eval()
    try:
        if mode == "stateful":
            result = evaluate_stateful(model, docs, context, **common)
        elif mode == "windows":
            result = evaluate_windows(model, docs, context, None, **common)
        else:
            result = evaluate_windows(model, docs, context, stride or max(1, context // 2), **common)
    finally:
        model.train(was_training)
    return all_reduce_result(result, group) if world_size > 1 else result


# --- distributed reduction ------------------------------------------------------------------------


def all_reduce_result(result: EvalResult, group: Any = None) -> EvalResult:
    """Sum a per-rank result over ``group`` (float64 for NLL, int64 for counts)."""
    if not comm.is_distributed():
        raise ValueError("group: all_reduce_result needs an initialised torch.distributed process group")
    group = group if group is not None else comm.world_group()  # this function's None: every rank
    floats = comm.all_reduce(torch.tensor([result.nll_sum, *result.bucket_nll], dtype=torch.float64), "sum", group)
    ints = comm.all_reduce(torch.tensor([result.tokens, result.bytes, *result.bucket_tokens], dtype=torch.int64), "sum", group)
    floats, ints = floats.tolist(), ints.tolist()
    return EvalResult(floats[0], int(ints[0]), int(ints[1]), floats[1:], [int(x) for x in ints[2:]])


# --- helpers --------------------------------------------------------------------------------------


def _device_of(model: torch.nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
