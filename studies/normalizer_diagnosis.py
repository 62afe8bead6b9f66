"""Why the ``rms`` output normalisation loses (docs/attention.md, "Why rms loses"): one experiment.

With exact softmax weights A (rows sum to 1) the attention output is the convex combination
``o = A v``. The ``rms`` normaliser replaces it by ``o / rms(o)`` (times a learned per-channel gain
that is the same for every query), i.e. it multiplies each query's output by ``g_t = 1 / rms(A v)_t``;
``capped_denominator`` leaves ``A v`` as it is unless its RMS exceeds 2. So the kernel study's
``softmax_rms`` control (1.51x softmax's perplexity with the exact softmax kernel) differs from
softmax only by ``g_t``. This script measures ``g_t`` on real text, per layer and query position,
at initialisation and in a trained softmax model, and relates it to how spread each query's
attention is (effective keys ``exp(entropy)``); and it compares the gradient that reaches the
attention's input projection at initialisation under both normalisers (same weights).

    python -m studies.normalizer_diagnosis --checkpoint RUN_DIR_OR_CHECKPOINT \\
        --out docs/results/normalizer_diagnosis

writes ``results.json`` and ``results.md`` there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from megaflex.cli_args import existing_dir, positive_int, writable_dir
from megaflex.model.config import ModelConfig
from megaflex.model.gpt import GPT

POSITION_BUCKETS = ((1, 1), (2, 4), (5, 16), (17, 64), (65, 256), (257, 1024))


def capture_attention_inputs(model: GPT, tokens: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """(q, k, v) as each layer's attention core receives them (after RoPE), for one forward."""
    captured: list[tuple[torch.Tensor, ...]] = []
    originals = []
    for block in model.blocks:
        core = block.attn.core
        original = core.forward

        def recording(q, k, v, *args, _original=original, **kwargs):
            captured.append((q.detach(), k.detach(), v.detach()))
            return _original(q, k, v, *args, **kwargs)

        originals.append((core, original))
        core.forward = recording
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        for core, original in originals:
            core.forward = original
    return captured


def rms_gain_statistics(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float = 1e-6) -> dict[str, Any]:
    """Per query of one layer ([B, H, N, d] each): the factor ``g = 1 / rms(A v)`` by which ``rms``
    rescales exact causal softmax attention, summarised by position bucket; and its correlation
    with log effective keys across queries."""
    n, d = q.shape[-2], q.shape[-1]
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(d)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)  # [B, H, N, N]
    out = weights @ v.double()  # softmax attention's output, what capped_denominator keeps
    gain = 1.0 / (out.pow(2).mean(-1) + eps * eps).sqrt()  # [B, H, N]
    entropy = -(weights * weights.clamp_min(1e-300).log()).sum(-1)
    positions = torch.arange(1, n + 1)
    buckets = {}
    for lo, hi in POSITION_BUCKETS:
        sel = (positions >= lo) & (positions <= hi)
        if not sel.any():
            continue
        g = gain[..., sel].flatten()
        buckets[f"{lo}-{hi}"] = {
            "median": g.median().item(), "p10": g.quantile(0.1).item(), "p90": g.quantile(0.9).item(),
            "effective_keys_median": entropy[..., sel].exp().median().item(),
            "capped": (out.pow(2).mean(-1)[..., sel].sqrt() > 2).double().mean().item(),  # where the cap binds
        }
    late = positions > n // 2  # queries with many keys: where the spread of g is not just position
    lg, le = gain[..., late].log().flatten(), entropy[..., late].flatten()
    corr = torch.corrcoef(torch.stack([lg, le]))[0, 1].item()
    return {"by_position": buckets, "log_gain_vs_entropy_corr_late": corr,
            "log_gain_std_late": lg.std().item()}


def init_gradient_scale(config: ModelConfig, tokens: torch.Tensor, seed: int) -> dict[str, Any]:
    """Gradient norms of each layer's qkv and output projection at initialisation, for the same
    initial weights under ``rms`` and under ``capped_denominator`` (rms adds unit gains only)."""
    out: dict[str, Any] = {}
    for normalization in ("rms", "capped_denominator"):
        torch.manual_seed(seed)
        model = GPT(ModelConfig(**{**config.to_dict(), "normalization": normalization}))
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        out[normalization] = {
            "loss": loss.item(),
            "qkv_grad_norm": [b.attn.qkv.weight.grad.norm().item() for b in model.blocks],
            "proj_grad_norm": [b.attn.proj.weight.grad.norm().item() for b in model.blocks],
        }
    return out


def load_windows(path: Path, tokenizer: Any, seq_len: int, count: int) -> torch.Tensor:
    """The first ``count`` windows of ``seq_len`` tokens of english-docs valid (documents concatenated)."""
    from megaflex.eval.eval_data import load_eval_set

    docs = load_eval_set(str(path), tokenizer, max_tokens=seq_len * count * 2).docs
    flat = torch.cat(docs)[: seq_len * count]
    return flat.view(count, seq_len)


def diagnose(checkpoint: str, data_root: str, windows: int, seed: int) -> dict[str, Any]:
    from megaflex.eval.loading import load_for_eval

    loaded = load_for_eval(checkpoint)
    trained = loaded.model
    config = trained.config
    if config.attention != "softmax" or config.softmax_window:
        raise ValueError(f"--checkpoint: expected a plain softmax model, got attention={config.attention!r}, "
                         f"softmax_window={config.softmax_window}")
    seq_len = (loaded.config.get("data") or {}).get("seq_len", config.max_seq_len)
    tokens = load_windows(Path(data_root) / "english-docs" / "valid.jsonl", loaded.tokenizer, seq_len, windows)
    torch.manual_seed(seed)
    initial = GPT(config).eval()
    result: dict[str, Any] = {"checkpoint": str(loaded.path), "seq_len": seq_len, "windows": windows, "seed": seed}
    for name, model in (("init", initial), ("trained", trained)):
        result[name] = [rms_gain_statistics(*qkv) for qkv in capture_attention_inputs(model, tokens)]
    linear = ModelConfig(**{**config.to_dict(), "attention": "flexformer_n"})
    result["init_gradients_flexformer_n"] = init_gradient_scale(linear, tokens, seed)
    return result


def write_markdown(result: dict[str, Any], path: Path, command: str) -> None:
    md = ["# Why rms loses: the gain it puts on softmax attention\n", f"Command: `{command}`\n",
          f"Checkpoint `{result['checkpoint']}`; {result['windows']} windows of {result['seq_len']} tokens of "
          "english-docs valid. g = 1 / rms(A v): the factor by which `rms` rescales the exact softmax output of "
          "each query (capped_denominator keeps A v unless its RMS exceeds 2). Median [p10, p90] over queries "
          "and heads, per layer and position bucket.\n"]
    for name in ("init", "trained"):
        layers = result[name]
        buckets = list(layers[0]["by_position"])
        md += [f"\n## {name}\n", "| layer | " + " | ".join(f"t {b}" for b in buckets)
               + " | corr(log g, entropy), t > N/2 | std log g, t > N/2 |",
               "|---" * (len(buckets) + 3) + "|"]
        for i, layer in enumerate(layers):
            cells = [f"{s['median']:.2f} [{s['p10']:.2f}, {s['p90']:.2f}]" for s in layer["by_position"].values()]
            md.append(f"| {i} | " + " | ".join(cells)
                      + f" | {layer['log_gain_vs_entropy_corr_late']:.2f} | {layer['log_gain_std_late']:.2f} |")
        keys = [f"{s['effective_keys_median']:.1f}" for s in layers[-1]["by_position"].values()]
        md.append(f"\nEffective keys (median, last layer) per bucket: {' / '.join(keys)}. Share of queries where "
                  "the cap binds (rms(A v) > 2), all layers: "
                  f"{max(s['capped'] for layer in layers for s in layer['by_position'].values()):.3f} at most.\n")
    grads = result["init_gradients_flexformer_n"]
    md += ["\n## Gradient at initialisation (Flexformer_n, same weights)\n",
           "| normaliser | loss | qkv grad norm per layer | proj grad norm per layer |", "|---|---|---|---|"]
    for name, g in grads.items():
        md.append(f"| {name} | {g['loss']:.4f} | {' / '.join(f'{x:.2e}' for x in g['qkv_grad_norm'])} | "
                  f"{' / '.join(f'{x:.2e}' for x in g['proj_grad_norm'])} |")
    path.write_text("\n".join(md) + "\n")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m studies.normalizer_diagnosis", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a trained plain softmax run (run dir, checkpoint dir or folder)")
    p.add_argument("--data-root", type=existing_dir, default=os.environ.get("MEGAFLEX_DATA", "../shared/data"))
    p.add_argument("--windows", type=positive_int, default=8, help="windows of the training length scored")
    p.add_argument("--seed", type=int, default=1234, help="seed of the initial models")
    p.add_argument("--out", type=writable_dir, required=True, help="folder for results.json and results.md")
    args = p.parse_args(argv)
    result = diagnose(args.checkpoint, args.data_root, args.windows, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    command = "python -m studies.normalizer_diagnosis " + " ".join(argv if argv is not None else os.sys.argv[1:])
    write_markdown(result, out / "results.md", command)
    print((out / "results.md").read_text())
    return result


if __name__ == "__main__":
    main()
