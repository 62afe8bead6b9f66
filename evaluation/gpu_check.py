"""GPU acceptance of the Triton attention path, in one command (<= 10 minutes on one GPU). Not a test.

    python -m evaluation.gpu_check [--json evaluation/results/gpu_check.json] [--dry-run | --device cpu]
                                   [--sections kernels layer train_step train_real]

Sections (each records its own errors, so one failure never hides the others):

* ``kernels``:    the Triton kernels (core and fused trig path), compiled, in fp32, bf16 and fp16,
  against the quadratic form in fp64 on the same inputs: normwise max error of the output, the
  final state and every gradient; pass when within the dtype's tolerance plus 10x the error of
  the quadratic form run in that dtype (what the dtype's rounding alone costs).
* ``layer``:      one attention layer forward + backward (B=1, 16 heads, d=64, F=128, bf16) at
  2k-64k tokens: Flexformer-N through ``trig_linear_attention`` vs SDPA (FlashAttention) vs
  fla's ``chunk_simple_gla`` on the same features ("not installed" without fla): ms, peak MB.
* ``train_step``: the real trainer (``megaflex.train``, one rank) on configs/flexformer_n_247m.yaml
  and configs/softmax_247m.yaml, bf16, ZeRO-1, synthetic tokens, at 2k and 8k tokens per
  sequence: tokens/s, peak memory, MFU (from the trainer's metrics.jsonl).
* ``train_real``: 20 optimiser steps of a small Flexformer-N on real text (WikiText-2 valid, bytes
  as tokens): the loss must fall.

``--dry-run`` (alias ``--device cpu``) runs every section at tiny sizes on CPU tensors, the
kernels under Triton's interpreter, so tests/test_eval_gpu_check.py exercises the script itself.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv or ("--device" in sys.argv and "cpu" in sys.argv):
    os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors: kernels run in the interpreter

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megaflex.attention import LinearAttentionState  # noqa: E402
from megaflex.attention.feature_maps._trig import trig_feature_map_reference  # noqa: E402
from megaflex.attention.quadratic import quadratic_linear_attention  # noqa: E402
from megaflex.attention.triton import trig_linear_attention, triton_linear_attention  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("kernels", "layer", "train_step", "train_real")
# normwise tolerance per dtype on top of 10x the quadratic form's own error in that dtype. The
# kernels' dot operands are in the inputs' dtype (fp32 inputs: tf32 on CUDA, 10 mantissa bits),
# so fp32 intermediates are rounded to it before their products (the interpreter: fp16 needs 2e-2
# at key scales x100, tests/test_attention_triton.py).
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 2e-2, torch.float16: 4e-3}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
def _case_inputs(n: int, feat: int, dv: int, heads: int, key_scale: float, with_state: bool, device: str, seed: int):
    """fp64 master copies of one case's inputs: features (signed), key log-scales, v, state."""
    g = torch.Generator().manual_seed(seed)
    x = {
        "qf": torch.randn(1, heads, n, feat, generator=g, dtype=torch.float64),
        "kf": torch.randn(1, heads, n, feat, generator=g, dtype=torch.float64),
        "kls": key_scale * torch.randn(1, heads, n, generator=g, dtype=torch.float64),
        "v": torch.randn(1, heads, n, dv, generator=g, dtype=torch.float64),
    }
    if with_state:
        x["kv0"] = torch.randn(1, heads, feat, dv, generator=g, dtype=torch.float64)
        x["k_sum0"] = torch.randn(1, heads, feat, generator=g, dtype=torch.float64)
        x["log_max0"] = key_scale * torch.randn(1, heads, generator=g, dtype=torch.float64)
    return {name: t.to(device) for name, t in x.items()}


def _evaluate(fn: Callable, master: dict[str, torch.Tensor], dtype: torch.dtype, compute: torch.dtype, normalization: str):
    """Run ``fn`` on ``master`` rounded to ``dtype`` (features, v) and held in ``compute``;
    returns {name: tensor} of the output, final state and gradients of a fixed random loss."""
    leaves = {
        name: t.to(dtype).to(compute).requires_grad_() if name in ("qf", "kf", "v") else t.to(compute if compute == torch.float64 else torch.float32).requires_grad_()
        for name, t in master.items()
        if name != "log_max0"
    }
    state = None
    if "kv0" in leaves:
        state = LinearAttentionState(leaves["kv0"], leaves["k_sum0"], master["log_max0"].to(leaves["kv0"].dtype), 0)
    out, final = fn(leaves["qf"], leaves["kf"], leaves["kls"], leaves["v"], normalization=normalization, initial_state=state)
    g = torch.Generator().manual_seed(7)
    loss = sum(
        (t.double() * torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.device)).sum()
        for t in (out, final.kv, final.k_sum)
    )
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {"out": out, "kv": final.kv, "k_sum": final.k_sum, **{f"d{k}": gr for k, gr in zip(leaves, grads)}}


def _errors(got: dict, exact: dict) -> dict[str, float]:
    return {
        name: (got[name].double() - ref).abs().max().item() / max(ref.abs().max().item(), 1.0) for name, ref in exact.items()
    }


def check_kernels(small: bool, device: str) -> dict[str, Any]:
    """Compiled (or interpreted) kernels vs the fp64 quadratic form, every dtype and gradient."""
    dtypes = [torch.float32, torch.float16] if device == "cpu" else [torch.float32, torch.bfloat16, torch.float16]
    lengths = (65,) if small else (1, 65, 200, 1000)
    feat, dv, heads = (16, 16, 2) if small else (128, 64, 4)
    cases = []
    for dtype in dtypes:
        for n in lengths:
            for normalization in ("rms", "denominator"):
                for with_state, key_scale in ((False, 1.0), (True, 100.0)):
                    master = _case_inputs(n, feat, dv, heads, key_scale, with_state, device, seed=n)
                    case = {"dtype": DTYPE_NAMES[dtype], "n": n, "normalization": normalization, "state": with_state, "key_scale": key_scale}
                    try:
                        exact = _evaluate(quadratic_linear_attention, master, dtype, torch.float64, normalization)
                        same = _errors(_evaluate(quadratic_linear_attention, master, dtype, dtype, normalization), exact)
                        triton = _errors(_evaluate(triton_linear_attention, master, dtype, dtype, normalization), exact)
                        scale = 1 + key_scale / 5  # exp arguments carry |kls| x eps rounding
                        worst = max(triton[k] - 10 * same[k] for k in triton)
                        case.update(max_error=max(triton.values()), reference_error=max(same.values()))
                        case["passed"] = worst <= TOLERANCE[dtype] * scale
                        case["errors"] = {k: float(f"{e:.3g}") for k, e in triton.items()}
                    except Exception as err:  # noqa: BLE001  (recorded, the run goes on)
                        case.update(passed=False, error=repr(err)[:500])
                    cases.append(case)
    trig = check_trig(small, device)
    return {"passed": all(c["passed"] for c in cases) and trig["passed"], "cases": cases, "trig": trig}


def check_trig(small: bool, device: str) -> dict[str, Any]:
    """Fused trig path vs (reference map + quadratic form) in fp64, gradients of q, k, v, omega, 1/T."""
    n, d, rows, heads = (65, 8, 16, 2) if small else (1000, 64, 64, 4)
    results = []
    for dtype in [torch.float32] if device == "cpu" else [torch.float32, torch.bfloat16]:
        for paired in (True, False):
            g = torch.Generator().manual_seed(3)
            q, k, v = (torch.randn(1, heads, n, d, generator=g, dtype=torch.float64) for _ in range(3))
            q, k = 0.5 * q, 0.5 * k
            omega = torch.randn(heads, rows, d, generator=g, dtype=torch.float64) * d**-0.25
            inv_t = torch.full((heads,), 1.0 / (2 * d**0.5), dtype=torch.float64)
            master = [t.to(device).to(dtype) for t in (q, k, v)] + [omega.to(device), inv_t.to(device)]

            def run(use_triton: bool, compute: torch.dtype):
                leaves = [t.to(compute).requires_grad_() for t in master[:3]] + [
                    t.to(compute if compute == torch.float64 else torch.float32).requires_grad_() for t in master[3:]
                ]
                if use_triton:
                    out, _ = trig_linear_attention(*leaves, paired=paired)
                else:
                    qf, _ = trig_feature_map_reference(leaves[0], leaves[3], leaves[4], paired=paired)
                    kf, kls = trig_feature_map_reference(leaves[1], leaves[3], leaves[4], paired=paired)
                    out, _ = quadratic_linear_attention(qf, kf, kls, leaves[2])
                weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(device)
                grads = torch.autograd.grad((out.double() * weight).sum(), leaves)
                return dict(zip(("out", "dq", "dk", "dv", "domega", "dinv_temperature"), (out, *grads)))

            try:
                exact = run(False, torch.float64)
                same, got = _errors(run(False, dtype), exact), _errors(run(True, dtype), exact)
                worst = max(got[k] - 10 * same[k] for k in got)
                results.append({"dtype": DTYPE_NAMES[dtype], "paired": paired, "max_error": max(got.values()),
                                "passed": worst <= TOLERANCE[dtype]})  # fmt: skip
            except Exception as err:  # noqa: BLE001
                results.append({"dtype": DTYPE_NAMES[dtype], "paired": paired, "passed": False, "error": repr(err)[:500]})
    return {"passed": all(r["passed"] for r in results), "cases": results}


# ---------------------------------------------------------------------------------------------
# layer benchmark
# ---------------------------------------------------------------------------------------------
def _timed(fn: Callable[[], None], device: str, repeats: int) -> tuple[float, float]:
    """(median ms, peak MB above the memory held before) of ``fn`` (forward + backward)."""
    fn()  # warm-up (compilation, autotuning)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device == "cuda" else float("nan")
    return sorted(times)[len(times) // 2], peak


def _layer_impls(heads: int, d: int, feat: int, device: str) -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | str]:
    """name -> attention(q, k, v) on [1, H, N, d] tensors, or why it is unavailable."""
    g = torch.Generator().manual_seed(0)
    omega = (torch.randn(heads, feat, d, generator=g) * d**-0.25).to(device).requires_grad_()  # paired: F = 2D rows
    inv_t = torch.full((heads,), 1.0 / (2 * d**0.5), device=device).requires_grad_()

    def flexformer_n(q, k, v):
        return trig_linear_attention(q, k, v, omega, inv_t, paired=True)[0]

    def sdpa(q, k, v):
        if device != "cuda":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    impls: dict[str, Any] = {"flexformer_n_triton": flexformer_n, "sdpa_flash" if device == "cuda" else "sdpa": sdpa}
    try:
        import fla  # noqa: F401

        from megaflex.attention.chunked_cuda import gla_linear_attention

        def fla_gla(q, k, v):  # the same trig features, attention by fla's chunk_simple_gla
            qf, _ = trig_feature_map_reference(q, omega, inv_t, paired=True)
            kf, kls = trig_feature_map_reference(k, omega, inv_t, paired=True)
            return gla_linear_attention(qf, kf, kls, v)[0]

        impls["fla_chunk_simple_gla"] = fla_gla if device == "cuda" else "needs CUDA"
    except ImportError:
        impls["fla_chunk_simple_gla"] = "not installed"
    return impls


def bench_layer(small: bool, device: str) -> dict[str, Any]:
    heads, d, feat = (2, 16, 16) if small else (16, 64, 128)
    lengths = (64, 128) if small else (2048, 8192, 16384, 32768, 65536)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    rows = []
    for name, impl in _layer_impls(heads, d, feat, device).items():
        for n in lengths:
            row: dict[str, Any] = {"impl": name, "seq_len": n, "heads": heads, "head_dim": d, "dtype": DTYPE_NAMES[dtype]}
            if isinstance(impl, str):
                rows.append({**row, "status": impl})
                continue
            g = torch.Generator().manual_seed(n)
            q, k, v = (torch.randn(1, heads, n, d, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
            grad = torch.randn(1, heads, n, d, generator=g).to(device, dtype)

            def step() -> None:
                impl(q, k, v).backward(grad)

            try:
                ms, peak = _timed(step, device, repeats=2 if small else 5)
                rows.append({**row, "status": "ok", "fwd_bwd_ms": round(ms, 3), "peak_mb": round(peak, 1)})
            except Exception as err:  # noqa: BLE001  (e.g. out of memory at 64k)
                rows.append({**row, "status": "error", "error": repr(err)[:300]})
            del q, k, v, grad
            if device == "cuda":
                torch.cuda.empty_cache()
    return {"rows": rows}


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------
def _trainer(config: str, overrides: list[str], run_dir: Path, device: str, timeout: float) -> dict[str, Any]:
    """One-rank ``megaflex.train`` run; its train records from metrics.jsonl (or the error)."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", LOCAL_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), PYTHONUNBUFFERED="1")  # fmt: skip
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env.pop("TRITON_INTERPRET", None)  # the trainer uses attention_backend=auto: torch on CPU
    zero = str(REPO / "configs" / "zero" / "zero1.yaml")
    cmd = [sys.executable, "-m", "megaflex.train", "--config", str(REPO / config), zero, *overrides, f"logging.run_dir={run_dir}"]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-1500:]}
    from megaflex.training.metrics import read_metrics

    return {"records": list(read_metrics(run_dir / "metrics.jsonl").values())}


def _run_overrides(seq_len: int, micro: int, steps: int, precision: str) -> list[str]:
    return [
        "data.source=synthetic", "data.tokenizer=null", f"data.seq_len={seq_len}", f"model.max_seq_len={seq_len}",
        f"train.micro_batch_size={micro}",
        f"train.global_batch_size={micro}", f"train.train_iters={steps}", "schedule.warmup_iters=0", f"train.precision={precision}",
        "train.eval_interval=0", "checkpoint.save_interval=0", "checkpoint.save_at_end=false", "checkpoint.resume=none",
        "logging.tensorboard=false", "logging.kernel_stats_interval=0", "logging.log_interval=1",
    ]  # fmt: skip


def bench_train_step(small: bool, device: str) -> dict[str, Any]:
    """247M Flexformer-N next to 247M softmax (tiny config on CPU): tokens/s, peak MB, MFU."""
    configs = {"flexformer_n": "configs/tiny.yaml", "softmax": "configs/tiny.yaml"} if small else {
        "flexformer_n": "configs/flexformer_n_247m.yaml", "softmax": "configs/softmax_247m.yaml"}  # fmt: skip
    cells = ((64, 2),) if small else ((2048, 8), (8192, 2))  # (tokens per sequence, sequences per step)
    rows = []
    for name, config in configs.items():
        for seq_len, micro in cells:
            overrides = _run_overrides(seq_len, micro, steps=3 if small else 6, precision="fp32" if device == "cpu" else "bf16")
            if small:
                overrides.append(f"model.attention={name}")
            with tempfile.TemporaryDirectory() as tmp:
                result = _trainer(config, overrides, Path(tmp) / "run", device, timeout=150 if device == "cuda" else 300)
            row: dict[str, Any] = {"model": name, "config": config, "seq_len": seq_len, "micro_batch": micro}
            if "error" in result:
                rows.append({**row, "error": result["error"]})
                continue
            steady = result["records"][1:] or result["records"]  # the first step includes warm-up
            row["tokens_per_s"] = sorted(r["tokens_per_s"] for r in steady)[len(steady) // 2]
            row["peak_memory_mb"] = max(r["memory_mb"] for r in result["records"])
            row["mfu"] = steady[-1].get("mfu")
            rows.append(row)
    return {"rows": rows}


def train_real(small: bool, device: str, steps: int = 20) -> dict[str, Any]:
    """``steps`` AdamW steps of a small Flexformer-N on WikiText-2 valid bytes: loss must fall."""
    from megaflex.model import GPT, ModelConfig

    data = Path(os.environ.get("MEGAFLEX_DATA", REPO.parent / "shared" / "data")) / "wikitext-2-raw" / "wiki.valid.raw"
    if not data.is_file():
        return {"passed": False, "error": f"real text not found at {data} (set MEGAFLEX_DATA)"}
    tokens = torch.frombuffer(bytearray(data.read_bytes()), dtype=torch.uint8).long()
    seq_len, batch = (64, 4) if small else (1024, 16)
    hidden, layers = (32, 2) if small else (512, 6)
    config = ModelConfig(vocab_size=256, num_layers=layers, hidden_size=hidden, num_heads=max(2, hidden // 64),
                         attention="flexformer_n", feature_dim=16 if small else 128, max_seq_len=seq_len)  # fmt: skip
    torch.manual_seed(0)
    model = GPT(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3 if small else 1e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch,), generator=g)
        window = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()]).to(device)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(window[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, 256), window[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    return {"passed": math.isfinite(last) and last < first, "losses": [round(x, 4) for x in losses],
            "first5_mean": first, "last5_mean": last, "backend": model.config.attention_backend}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
RUNNERS = {"kernels": check_kernels, "layer": bench_layer, "train_step": bench_train_step, "train_real": train_real}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--dry-run", action="store_true", help="every section at tiny sizes on CPU (interpreter)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="cpu: same as --dry-run")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run or args.device == "cpu" else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --dry-run / --device cpu for the tiny CPU run")
    small = device == "cpu"
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run, Triton interpreter)",
        "torch": torch.__version__,
        "dry_run": small,
    }
    for section in args.sections:
        start = time.perf_counter()
        try:
            report[section] = RUNNERS[section](small, device)
        except Exception as err:  # noqa: BLE001  (a section's crash is a result too)
            report[section] = {"passed": False, "error": repr(err)[:1000]}
        report[section]["seconds"] = round(time.perf_counter() - start, 1)
        print(f"[gpu_check] {section}: {report[section].get('passed', 'done')} in {report[section]['seconds']} s", flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        print(f"[gpu_check] written {args.json}")
    return report


if __name__ == "__main__":
    main()
