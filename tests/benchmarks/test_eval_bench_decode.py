"""benchmarks/decode.py bookkeeping on a tiny model: the decoding state it times is positioned
where it claims (Flexformer's state constant in size, softmax's KV cache linear in the context)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.decode import main

TINY = ["--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32", "--num-heads", "2", "--feature-dim", "16"]


def test_decode_bench_positions_states_and_reports_every_batch(tmp_path: Path) -> None:
    result = main(TINY + ["--contexts", "100,300", "--batch-sizes", "1,3", "--steps", "2", "--warmup", "1",
                          "--prefill", "8", "--threads", "1", "--out", str(tmp_path)])
    rows = {(r["kind"], r["batch_size"], r["context"]): r for r in result["rows"]}
    assert set(rows) == {(k, b, c) for k in ("flexformer_n", "softmax") for b in (1, 3) for c in (100, 300)}
    for batch in (1, 3):
        flex = [rows["flexformer_n", batch, c]["state_mb"] for c in (100, 300)]
        soft = [rows["softmax", batch, c]["state_mb"] for c in (100, 300)]
        assert flex[0] == flex[1] > 0
        # 2 layers x (k, v) x batch x 2 heads x context x 16 dims x 4 bytes
        assert [round(m * 2**20) for m in soft] == [2 * 2 * batch * 2 * c * 16 * 4 for c in (100, 300)]
        r = rows["flexformer_n", batch, 300]
        assert abs(r["tokens_per_s"] - batch * 1000 / r["ms_per_token"]) < 1e-6
    saved = json.loads((tmp_path / "decode.json").read_text())
    assert set(saved["speedup_vs_softmax"]) == {"batch 1", "batch 3"}
    assert (tmp_path / "decode.png").stat().st_size > 0
