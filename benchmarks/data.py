"""Data-pipeline benchmark (not a test): preprocessing throughput, index build, sample reads.

    python -m benchmarks.data [--out docs/results/bench_data.json] [--quick]

1. Preprocessing MB/s and tokens/s on english-docs (62 MB JSONL) with 1 and 2 processes, using a
   BPE tokenizer trained on a sample of it (``--vocab-size``).
2. Index build (doc/sample/shuffle indices + cache write) for a synthetic dataset of 1 billion
   tokens in 10 million documents: wall time and peak RSS of a fresh process. Only the ``.idx`` is
   real; the 2 GB ``.bin`` is a sparse file, since index building never reads tokens.
3. Random-sample read latency (p50/p99, µs) of ``GPTDataset[i]`` at seq_len 2048 on english-docs.
4. Opening that 1-billion-token index as training does (``IndexedDataset(verify=True)`` + the
   bounded token-id sample ``check_token_sample``), against a plain open, in a fresh process.
   ``--only-open-checks`` runs just this part and updates its entry in an existing JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from megaflex.cli_args import positive_int, scratch_results, writable_file

REPO = Path(__file__).resolve().parents[1]


def data_root() -> Path:
    return Path(os.environ.get("MEGAFLEX_DATA", REPO.parent / "shared" / "data"))


def bench_preprocess(work: Path, vocab_size: int, files: list[str]) -> dict:
    from data_prep.preprocess import PreprocessConfig, preprocess
    from data_prep.train_tokenizer import TokenizerTrainConfig, train_tokenizer

    t0 = time.perf_counter()
    model = train_tokenizer(TokenizerTrainConfig(inputs=files, vocab_size=vocab_size,
                                                 output_prefix=str(work / "tok"), max_sentences=200_000))
    out: dict = {"tokenizer": {"vocab_size": vocab_size, "train_seconds": round(time.perf_counter() - t0, 1)}}
    for n in (1, 2):
        s = preprocess(PreprocessConfig(files, str(model), str(work / f"en{n}"), num_proc=n, progress=False))
        out[f"num_proc_{n}"] = {k: round(s[k], 3) if isinstance(s[k], float) else s[k]
                                for k in ("documents", "tokens", "text_bytes", "seconds", "mb_per_s", "tokens_per_s",
                                          "cpu_seconds", "mb_per_cpu_s")}
        out[f"num_proc_{n}"]["load_average_1m"] = round(os.getloadavg()[0], 1)
    return out


def write_synthetic_idx(prefix: Path, n_docs: int, n_tokens: int, seed: int = 0) -> None:
    """A valid megatron .idx with ``n_docs`` documents summing to ``n_tokens``; sparse uint16 .bin."""
    from megaflex.data.indexed import MAGIC, VERSION, dtype_code

    rng = np.random.default_rng(seed)
    lengths = rng.geometric(n_docs / n_tokens, n_docs).astype(np.int64)  # mean n_tokens / n_docs
    lengths = np.clip(lengths, 1, 2**31 - 1)
    lengths[-1] += n_tokens - lengths.sum()  # exact total
    if lengths[-1] < 1:
        raise RuntimeError("synthetic lengths overshoot; use another seed")
    pointers = np.zeros(n_docs, np.int64)
    np.cumsum(lengths[:-1] * 2, out=pointers[1:])
    with open(f"{prefix}.idx", "wb") as f:
        f.write(MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", dtype_code(np.uint16)))
        f.write(struct.pack("<QQ", n_docs, n_docs + 1))
        f.write(lengths.astype(np.int32).tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(n_docs + 1, dtype=np.int64).tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(n_tokens * 2)


_BUILD_CHILD = r"""
import json, sys, time
from megaflex.data import GPTDataset
t = time.perf_counter()
ds = GPTDataset(sys.argv[1], "train", int(sys.argv[2]), None, seed=1234, split="949,50,1", cache_dir=sys.argv[3])
sec = time.perf_counter() - t
# VmHWM is this process's own peak RSS (ru_maxrss would include the parent's, inherited over fork)
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"seconds": sec, "peak_rss_mib": hwm / 1024,
                  "num_samples": len(ds), "train_documents": ds.doc_range[1] - ds.doc_range[0], "built": ds.built_indices}))
"""


def bench_index_build(work: Path, n_docs: int, n_tokens: int, seq_len: int) -> dict:
    prefix = work / "synthetic"
    t0 = time.perf_counter()
    write_synthetic_idx(prefix, n_docs, n_tokens)
    out = {"documents": n_docs, "tokens": n_tokens, "seq_len": seq_len, "write_idx_seconds": round(time.perf_counter() - t0, 1)}
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    # second run per seq_len finds the cache and memory-maps it; a short seq_len means many samples
    for sl, phase in ((seq_len, "build"), (seq_len, "cached_load"), (128, "build_seq_len_128")):
        r = subprocess.run([sys.executable, "-c", _BUILD_CHILD, str(prefix), str(sl), str(work / "cache")],
                           capture_output=True, text=True, env=env, check=True)
        res = json.loads(r.stdout.strip().splitlines()[-1])
        out[phase] = {k: round(v, 2) if isinstance(v, float) else v for k, v in res.items()}
    return out


_OPEN_CHILD = r"""
import json, sys, time
from megaflex.data import IndexedDataset
t = time.perf_counter()
ds = IndexedDataset(sys.argv[1])
plain = time.perf_counter() - t
t = time.perf_counter()
ds.verify()
verify = time.perf_counter() - t
t = time.perf_counter()
ds.check_token_sample(int(sys.argv[2]))
sample = time.perf_counter() - t
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"plain_open_seconds": plain, "verify_seconds": verify, "token_sample_seconds": sample,
                  "checked_open_seconds": plain + verify + sample, "peak_rss_mib": hwm / 1024}))
"""


def bench_open_checks(work: Path, n_docs: int, n_tokens: int, vocab_size: int, repeats: int = 3) -> dict:
    """Seconds to open a ``n_tokens`` index with the training-time checks (best of ``repeats`` fresh processes)."""
    prefix = work / "synthetic_open"
    write_synthetic_idx(prefix, n_docs, n_tokens)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    runs = []
    for _ in range(repeats):
        r = subprocess.run([sys.executable, "-c", _OPEN_CHILD, str(prefix), str(vocab_size)],
                           capture_output=True, text=True, env=env, check=True)
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    best = min(runs, key=lambda x: x["checked_open_seconds"])
    return {"documents": n_docs, "tokens": n_tokens, "idx_bytes": (prefix.with_suffix(".idx")).stat().st_size,
            "repeats": repeats, **{k: round(v, 3) for k, v in best.items()},
            "load_average_1m": round(os.getloadavg()[0], 1)}


def bench_reads(prefix: str, seq_len: int, n: int = 2000) -> dict:
    from megaflex.data import GPTDataset

    ds = GPTDataset(prefix, "train", seq_len, None, seed=1, split="1,0,0")
    rng = np.random.default_rng(0)
    idx = rng.integers(0, len(ds), n)
    lat = np.empty(n)
    for k, i in enumerate(idx):
        t = time.perf_counter()
        ds[int(i)]
        lat[k] = time.perf_counter() - t
    return {"seq_len": seq_len, "samples": len(ds), "reads": n, "p50_us": round(float(np.percentile(lat, 50)) * 1e6, 1),
            "p99_us": round(float(np.percentile(lat, 99)) * 1e6, 1), "mean_us": round(float(lat.mean()) * 1e6, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=writable_file, default=str(scratch_results("bench_data.json")))
    ap.add_argument("--vocab-size", type=positive_int, default=16000)
    ap.add_argument("--docs", type=positive_int, default=10_000_000)
    ap.add_argument("--tokens", type=positive_int, default=1_000_000_000)
    ap.add_argument("--seq-len", type=positive_int, default=2048)
    ap.add_argument("--quick", action="store_true", help="english-docs valid only, 1M-document synthetic case")
    ap.add_argument("--only-open-checks", action="store_true",
                    help="run only part 4 and update its entry in --out (other entries are kept)")
    a = ap.parse_args(argv)
    if a.only_open_checks:
        results = json.loads(Path(a.out).read_text()) if Path(a.out).is_file() else {}
        with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
            results["open_checks"] = bench_open_checks(Path(tmp), a.docs, a.tokens, a.vocab_size)
        print(json.dumps(results["open_checks"], indent=1), flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {a.out}")
        return 0
    en = data_root() / "english-docs"
    files = [str(en / "valid.jsonl")] if a.quick else [str(en / f"{f}.jsonl") for f in ("train-00", "train-01", "valid")]
    if a.quick:
        a.docs, a.tokens = a.docs // 10, a.tokens // 10
    results: dict = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "note": "shared 2-core VM"}}
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        work = Path(tmp)
        results["preprocess"] = bench_preprocess(work, a.vocab_size, files)
        print(json.dumps(results["preprocess"], indent=1), flush=True)
        results["index_build"] = bench_index_build(work, a.docs, a.tokens, a.seq_len)
        print(json.dumps(results["index_build"], indent=1), flush=True)
        results["random_read"] = bench_reads(str(work / "en1"), a.seq_len)
        print(json.dumps(results["random_read"], indent=1), flush=True)
        results["open_checks"] = bench_open_checks(work, a.docs, a.tokens, a.vocab_size)
        print(json.dumps(results["open_checks"], indent=1), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
