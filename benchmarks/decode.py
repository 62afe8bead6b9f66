"""Decode latency per token vs context length: Flexformer's recurrent state vs a softmax KV cache.

    python -m benchmarks.decode                                   # 1k ... 64k, both kinds
    python -m benchmarks.decode --contexts 1024,4096 --steps 8    # quick

For each attention kind (same GPT otherwise) and context length L, the model is put at position
L and ``--steps`` single-token forwards are timed (median ms per token). The state at L is built
*synthetically*: a short real prefill, then the linear state's offset is moved to L (its size
does not depend on L — that is the point) and the softmax KV cache is tiled to L entries (its
size is L, and so is the work per token). Per-token cost depends only on these shapes, so this
measures exactly the decode cost at L without paying an O(L^2) softmax prefill;
``--real-prefill`` does the real chunked prefill instead (slow at long contexts, for checking).

``--batch-sizes`` (default 1 and 8): sequences decoded together, one token each per step.
Batch 1 is latency; there every step reads all weights once, so the softmax/Flexformer ratio is
bounded by about 1 + (KV cache bytes) / (weight bytes) on a memory-bound machine. A serving batch
shares one read of the weights across sequences while each sequence reads its own KV cache, which
is where a constant-size state pays off most.

Writes ``decode.json`` and ``decode.png`` under ``--out`` (default ``$XDG_CACHE_HOME/megaflex/decode``;
``docs/results``: the committed ones).
Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any, Sequence

import torch

from benchmarks.common import add_model_arguments, model_config
from megaflex.cli_args import (
    available_device, nonnegative_int, positive_int, positive_int_list, scratch_results, writable_dir,
)
from megaflex.attention.softmax import KVCache
from megaflex.model.gpt import GPT, GPTState

DEFAULT_CONTEXTS = "1024,2048,4096,8192,16384,32768,65536"


def build_model(kind: str, args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    config = model_config(args, kind, max_seq_len=max(args.contexts) + args.steps + 1)
    return GPT(config).to(args.device).eval()


def state_bytes(state: GPTState) -> int:
    """Bytes of the decoding state's contents (a KV cache's filled slots, not its reserve)."""
    total = 0
    for layer in state.layers:
        tensors = (layer.k, layer.v) if isinstance(layer, KVCache) else (layer.kv, layer.k_sum, layer.log_max)
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


@torch.no_grad()
def state_at(model: GPT, context: int, prefill: int, real: bool, device: str, batch: int = 1) -> GPTState:
    """A decoding state positioned after ``context`` tokens (see the module docstring)."""
    g = torch.Generator().manual_seed(0)
    if real:
        ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=g).to(device)
        state = None
        for begin in range(0, context, 1024):
            state = model(ids[:, begin : begin + 1024], state=state, return_state=True).state
        return state
    ids = torch.randint(0, model.config.vocab_size, (batch, prefill), generator=g).to(device)
    state = model(ids, return_state=True).state
    layers = []
    for layer in state.layers:
        if isinstance(layer, KVCache):
            reps = -(-context // prefill)
            k = layer.k.repeat(1, 1, reps, 1)[:, :, :context].contiguous()
            v = layer.v.repeat(1, 1, reps, 1)[:, :, :context].contiguous()
            layers.append(KVCache(k, v))
        else:
            layers.append(dataclasses.replace(layer, offset=context))
    return GPTState(layers=layers, offset=context)


@torch.no_grad()
def time_decode(model: GPT, state: GPTState, steps: int, warmup: int, device: str, batch: int = 1) -> list[float]:
    """Seconds of each single-token forward (state carried), after ``warmup`` untimed ones."""
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    times = []
    for i in range(warmup + steps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(token, state=state, return_state=True)
        token = model.gather_logits(out.logits[:, -1:]).argmax(-1)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        state = out.state
    return times


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for kind in args.kinds:
        model = build_model(kind, args)
        for batch in args.batch_sizes:
            for context in args.contexts:
                state = state_at(model, context, args.prefill, args.real_prefill, args.device, batch)
                times = time_decode(model, state, args.steps, args.warmup, args.device, batch)
                ms = 1000 * statistics.median(times)
                rows.append({"kind": kind, "batch_size": batch, "context": context, "ms_per_token": ms,
                             "ms_per_token_min": 1000 * min(times), "tokens_per_s": batch * 1000 / ms,
                             "state_mb": state_bytes(state) / 2**20})
                print(f"{kind:>14} batch {batch:>2} context {context:>6}: {ms:.2f} ms/token "
                      f"({rows[-1]['tokens_per_s']:.0f} tokens/s), state {rows[-1]['state_mb']:.1f} MB", flush=True)
                del state
    return rows


def speedups(rows: list[dict[str, Any]], baseline: str = "softmax", kind: str = "flexformer_n") -> dict[str, dict[int, float]]:
    """"batch B" -> {context: softmax ms / flexformer ms}."""
    result = {}
    for batch in sorted({r["batch_size"] for r in rows}):
        base = {r["context"]: r["ms_per_token"] for r in rows if r["kind"] == baseline and r["batch_size"] == batch}
        mine = {r["context"]: r["ms_per_token"] for r in rows if r["kind"] == kind and r["batch_size"] == batch}
        result[f"batch {batch}"] = {c: base[c] / mine[c] for c in sorted(base.keys() & mine.keys())}
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default="flexformer_n,softmax")
    p.add_argument("--contexts", type=positive_int_list, default=DEFAULT_CONTEXTS)
    p.add_argument("--batch-sizes", type=positive_int_list, default="1,8", help="sequences decoded together (1: latency; more: serving)")
    p.add_argument("--steps", type=positive_int, default=16, help="timed decode steps per context")
    p.add_argument("--warmup", type=nonnegative_int, default=3)
    p.add_argument("--prefill", type=positive_int, default=64, help="real tokens before the synthetic jump to the context")
    p.add_argument("--real-prefill", action="store_true", help="prefill all context tokens for real (slow)")
    add_model_arguments(p)
    p.add_argument("--device", type=available_device, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=writable_dir, default=str(scratch_results("decode")))
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from megaflex.eval.plotting import line_plot, write_json

    args = build_parser().parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args)
    result = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows, "speedup_vs_softmax": speedups(rows),
              "torch_threads": torch.get_num_threads()}
    write_json(f"{args.out}/decode.json", result)
    series = {
        f"{k}, batch {b}": [(r["context"], r["ms_per_token"]) for r in rows if r["kind"] == k and r["batch_size"] == b]
        for k in args.kinds
        for b in args.batch_sizes
    }
    line_plot(f"{args.out}/decode.png", series, title="Decode latency per token (per sequence)",
              xlabel="context (tokens)", ylabel="ms / token", logx=True, logy=True)
    for batch, by_context in result["speedup_vs_softmax"].items():
        for c, s in by_context.items():
            print(f"{batch}, context {c}: flexformer_n is {s:.1f}x faster per token than softmax")
    return result


if __name__ == "__main__":
    main()
