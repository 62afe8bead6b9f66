"""benchmarks/gpu_check/warm_cache.py: gpu_check's launches recorded at their real shapes, a cache
moved elsewhere found again after ``relocate``, and (slow) a warmed, pruned cache that Triton hits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install 'megaflex[dev]' installs it)")

from benchmarks.gpu_check.warm_cache import LAUNCH_SETS, LaunchSet, record, relocate  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_trainer_launches_are_recorded_with_their_runtime_values():
    launches = record((LaunchSet("trainer", "trig", "bfloat16", 2, 16, 1024, 64, 128, 64),))
    assert {launch["kernel"] for launch in launches} == {
        "chunk_states", "chunk_outputs", "chunk_state_grads", "chunk_grads_qk", "chunk_grads_v", "trig_grads"}  # fmt: skip
    states = next(launch for launch in launches if launch["kernel"] == "chunk_states")
    # ..., N, F, DV, NC, W (omega), HEADS, DIN, trig_scale: the values Triton specialises on (16 | N, HEADS = 16)
    assert states["args"][-8:] == [1024, 128, 64, 16, {"tensor": "float32"}, 16, 64, 256**-0.5]
    assert states["args"][:2] == [{"tensor": "bfloat16"}, {"tensor": "bfloat16"}]  # raw k, v
    assert states["constexprs"]["TRIG"] is True and states["constexprs"]["BF"] == 16


def test_every_launch_set_records():
    names = {launch["set"] for launch in record(LAUNCH_SETS)}
    assert names == {spec.name for spec in LAUNCH_SETS}


def test_relocate_lets_triton_find_a_moved_cache(tmp_path, monkeypatch):
    from triton import knobs
    from triton.runtime.cache import FileCacheManager

    entry = tmp_path / "moved" / "ENTRY"
    entry.mkdir(parents=True)
    for name in ("k.json", "k.cubin"):
        (entry / name).write_text("{}")
    old = {name: f"/build/cache/ENTRY/{name}" for name in ("k.json", "k.cubin", "k.ptx")}  # k.ptx: pruned
    (entry / "__grp__k.json").write_text(json.dumps({"child_paths": old}))
    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path / "moved"))
    assert not FileCacheManager("ENTRY").get_group("k.json")  # a miss ({} or None): Triton would compile again
    assert relocate(tmp_path / "moved") == 1
    assert FileCacheManager("ENTRY").get_group("k.json") == {name: str(entry / name) for name in ("k.json", "k.cubin")}


@pytest.mark.slow
def test_warmed_pruned_cache_is_hit(tmp_path):
    """Compile one launch (both autotuner configs) for sm_90, keep only metadata and cubins, and
    warm again in a new process: Triton loads every entry from the disk cache (a recompile would
    bring its IR files back)."""
    cache = tmp_path / "cache"
    script = textwrap.dedent(f"""
        import json, sys
        from pathlib import Path
        from benchmarks.gpu_check.warm_cache import LaunchSet, compile_launches, keep_binaries, record
        launch = record((LaunchSet("t", "features", "bfloat16", 1, 16, 1024, 64, 128, 64),))[:1]
        done = compile_launches(launch, Path({str(cache)!r}))
        if sys.argv[1] == "prune":
            keep_binaries(Path({str(cache)!r}))
        print(json.dumps(done))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    runs = []
    for mode in ("prune", "again"):
        done = subprocess.run([sys.executable, "-c", script, mode], env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert len(first) == 2 and first == second  # chunk_states: 4 and 8 warps, the same entries again
    assert sorted(p.name for p in cache.iterdir()) == sorted(e["entry"] for e in first)
    assert {p.suffix for p in cache.glob("*/*")} == {".json", ".cubin"}  # no IR came back: both were hits
    metadata = json.loads((cache / first[0]["entry"] / "chunk_states.json").read_text())
    assert metadata["target"]["arch"] == 90 and metadata["num_warps"] == first[0]["num_warps"]
