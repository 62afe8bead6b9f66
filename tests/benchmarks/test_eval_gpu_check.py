"""``python -m benchmarks.gpu_check --dry-run``: every stage of the one-call GPU acceptance runs at tiny
shapes on CPU (kernels under Triton's interpreter, the real trainer as subprocesses) and writes its
fields into the JSON report; with stand-in stages (tests/helpers/gpu_check_stubs.py): the global deadline,
rows that survive a timeout, the exit status of caught failures, and SIGTERM taking the running
stage's whole process group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install 'megaflex[dev]' installs it)")

import benchmarks.gpu_check.__main__ as gpu_check  # noqa: E402
import gpu_check_stubs  # noqa: E402
from benchmarks.gpu_check.__main__ import STAGES  # noqa: E402
from benchmarks.gpu_check.profile_summary import category  # noqa: E402
from benchmarks.gpu_check.report import caught_failures  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(1500)  # seven stages in subprocesses, about 5 minutes on 2 loaded cores
@pytest.mark.usefixtures("forked_python")  # its stages and their training runs: forked, not fresh interpreters
def test_gpu_check_dry_run_runs_every_stage(tmp_path):
    from benchmarks.gpu_check.__main__ import main

    status = main(["--dry-run", "--out", str(tmp_path), "--triton-cache", str(tmp_path / "triton")])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert status == 0 and report["failures"] == [], {name: stage.get("log_tail") for name, stage in report["stages"].items()}
    stages = report["stages"]
    assert report["dry_run"] is True and list(stages) == list(STAGES)  # every stage, most valuable first
    assert all(s["stage_status"] == "ok" and s["seconds"] > 0 for s in stages.values()), stages
    assert report["triton_cache_dir"] == str(tmp_path / "triton")

    env_stage = stages["environment"]
    assert env_stage["versions"]["torch"] and env_stage["triton_imported"]["version"]
    assert Path(env_stage["triton_imported"]["path"]).exists()
    assert "passed" in env_stage["pip_check"] and "cuda_available" in env_stage

    flex = stages["trainer_247m"]
    assert flex["tokens_per_s"] > 0 and flex["peak_memory_mb"] > 0 and flex["skipped_steps"] == 0
    assert sorted(int(s) for s in flex["losses"]) == list(range(1, 13))
    assert flex["checkpoints"] == ["step_00000010"]
    assert flex["resume"]["steps_run"] == [11, 12] and flex["resume"]["passed"], flex["resume"]
    profile = flex["profile_steps_6_8"]
    assert profile["steps"] == 3 and profile["ms_per_step"]["gemm"] > 0 and profile["ms_per_step"]["attention"] > 0
    assert profile["attention_kernels_ms_per_step"] and "dtoh_copies_per_step" in profile
    assert profile["item_reads_per_step"] >= 0

    softmax = stages["softmax_247m"]
    assert softmax["tokens_per_s"] > 0
    assert softmax["flexformer_over_softmax_tokens_per_s"] == pytest.approx(flex["tokens_per_s"] / softmax["tokens_per_s"], rel=1e-3)

    sweep = stages["kernel_sweep"]
    rows = {(r["impl"], r["N"]): r for r in sweep["rows"]}
    for impl in ("flexformer_kernel", "flexformer_trig", "sdpa"):
        assert rows[(impl, 64)]["status"] == "ok" and rows[(impl, 64)]["fwd_bwd_ms"] > 0, rows
    assert rows[("fla_chunk_simple_gla", 64)]["status"] in ("not installed", "needs CUDA")
    probe = sweep["int32_probe"]
    assert probe["passed"] and probe["elements"] == probe["B"] * probe["H"] * probe["N"] * probe["F"]
    assert probe["bound"] == 2 * 2.0**-23 * 2.0 ** __import__("math").floor(__import__("math").log2(probe["max_abs_out"]))
    assert "status" in sweep["aot_report"]

    precision = stages["precision_41m"]
    for name in ("fp32", "bf16"):
        run = precision["runs"][name]
        assert run["final_loss"] < run["first_loss"], run  # learnable tokens: the loss falls
        assert len(run["tau_mean_by_step"]) >= 2
    assert "final_loss_gap_bf16_minus_fp32" in precision and "tf32" in precision["fp32_arm"]
    accum = precision["runs"]["bf16_fp32_accum"]
    assert accum == {"skipped": "dry run: config checked, not trained"}  # the GPU run trains it
    storage = precision["bf16_storage"]
    assert storage["passed"] and storage["kernel_parameters"] > 0
    assert 0 < storage["kernel_params_bf16"]["grad_one_minus_cosine"] < 1e-3

    accuracy = stages["kernel_accuracy"]
    assert accuracy["passed"] and len(accuracy["cases"]) == accuracy["planned"]
    assert {c["dtype"] for c in accuracy["cases"]} == {"fp32", "fp16"}
    assert {(c["path"], c.get("paired")) for c in accuracy["cases"]} == {("features", None), ("trig", True), ("trig", False)}

    window = stages["window_kernels"]
    assert window["passed"] and {c["dtype"] for c in window["cases"]} == {"fp32", "fp16"}
    assert {r["impl"] for r in window["speed"] if r["status"] == "ok"} == {"triton", "torch"}


def test_profile_categories():
    assert category("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm" and category("aten::baddbmm_") == "gemm"
    assert category("chunk_grads") == "attention" and category("flash_fwd_kernel") == "attention"
    assert category("_TrigFeatureMapBackward") == "feature_maps" and category("aten::cos") == "feature_maps"
    assert category("aten::copy_") == "other"


def test_gpu_check_refuses_to_run_without_cuda_unless_dry_run():
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA: the real run is the one to use")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--stages", "environment"],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and "no usable CUDA device" in proc.stderr


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def _wait_until_gone(pids: list[int], seconds: float = 60.0) -> list[int]:
    """The pids still alive after waiting up to ``seconds`` for them to go (reaping takes a moment)."""
    end = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _run_stubs(monkeypatch, tmp_path, names: list[str], *extra: str, **timeouts: float) -> tuple[int, dict]:
    monkeypatch.setattr(gpu_check, "STAGES", gpu_check_stubs.stages(**timeouts))
    status = gpu_check.main(["--dry-run", "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"),
                             "--triton-cache", str(tmp_path / "triton"), "--stages", *names, *extra])  # fmt: skip
    return status, json.loads((tmp_path / "out" / "gpu_check.json").read_text())


def test_deadline_cuts_the_running_stage_and_skips_the_rest(monkeypatch, tmp_path):
    """A 15 s deadline: the quick stage runs, the hanging one (own timeout 300 s) is cut at the
    deadline with its rows kept, the last one is skipped with the reason; both are *not run (time)*,
    not failures: exit status 3 (incomplete)."""
    status, report = _run_stubs(monkeypatch, tmp_path, ["quick", "hang", "late"], "--deadline", "15")
    stages = report["stages"]
    assert status == 3 and report["deadline_s"] == 15 and report["verdict"] == "incomplete"
    assert stages["quick"]["stage_status"] == "ok" and stages["quick"]["passed"]
    # one Triton cache: the stage's and its trainers' (launcher_env keeps a TRITON_CACHE_DIR that is set)
    assert stages["quick"]["triton_cache_dir"] == stages["quick"]["trainer_triton_cache_dir"] == str(tmp_path / "triton")
    assert stages["hang"]["stage_status"].startswith("not run (time): cut at the deadline after")
    assert stages["hang"]["seconds"] < 300
    assert stages["hang"]["rows"] == [{"row": 0}, {"row": 1}, {"row": 2}]
    assert stages["late"]["stage_status"].startswith("not run (time): skipped, needs ~1 s")
    assert "of the 15 s deadline" in stages["late"]["stage_status"]
    assert report["failures"] == [] and report["not_run_time"] == ["hang", "late"]


def test_a_failure_outranks_a_stage_not_run_for_time(monkeypatch, tmp_path):
    """Something ran and was wrong (exit 1) even when another stage was cut for time."""
    status, report = _run_stubs(monkeypatch, tmp_path, ["caught", "hang"], "--deadline", "15")
    assert status == 1 and report["verdict"] == "failed" and report["not_run_time"] == ["hang"]
    assert report["failures"][0].startswith("caught/")


def test_nan_deadline_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--dry-run", "--deadline", "nan"])
    assert exit_info.value.code == 2 and "--deadline" in capsys.readouterr().err


def test_stage_timeout_keeps_its_rows_and_kills_its_process_group(monkeypatch, tmp_path):
    status, report = _run_stubs(monkeypatch, tmp_path, ["hang"], hang=15)
    hang = report["stages"]["hang"]
    assert status == 1 and hang["stage_status"] == "timed out after 15 s" and report["verdict"] == "failed"
    assert hang["rows"] == [{"row": 0}, {"row": 1}, {"row": 2}] and "log_tail" in hang
    pids = json.loads((tmp_path / "work" / "hang" / "pids.json").read_text())
    assert _wait_until_gone([pids["stage"], pids["child"]]) == []  # the stage's child went with it


def test_caught_failures_make_the_exit_status_nonzero_and_are_printed(monkeypatch, tmp_path, capsys):
    status, report = _run_stubs(monkeypatch, tmp_path, ["quick", "caught"])
    assert status == 1 and report["stages"]["caught"]["stage_status"] == "ok"
    expected = ["caught/trainer: error: exit 1: boom", "caught/cases[1](dtype=bf16): passed=False (max_error 0.5)"]
    assert report["failures"] == expected
    err = capsys.readouterr().err
    assert all(f"[gpu_check] FAILED {line}" in err for line in expected), err
    assert caught_failures({"passed": True, "cases": [{"passed": True}]}) == []


def test_sigterm_kills_the_running_stage_process_group(tmp_path):
    """SIGTERM to gpu_check (an outer timeout): the stage and the child it started (its own
    session, so no signal reaches them otherwise) are killed; the report says why; exit 143."""
    work, out = tmp_path / "work", tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.gpu_check_stubs", "--dry-run", "--out", str(out), "--work-dir", str(work),
         "--triton-cache", str(tmp_path / "triton"), "--stages", "hang"],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    pids_file, pids = work / "hang" / "pids.json", []
    try:
        end = time.monotonic() + 240
        while not pids_file.exists() and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.1)
        assert pids_file.exists(), proc.communicate(timeout=60)[0]
        pids = list(json.loads(pids_file.read_text()).values())
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=120)[0].decode()
        assert proc.returncode == 128 + signal.SIGTERM, output
        assert _wait_until_gone(pids) == []
        report = json.loads((out / "gpu_check.json").read_text())
        assert report["interrupted"] == "SIGTERM during hang" and "interrupted: SIGTERM during hang" in output
        assert report["stages"]["hang"]["rows"] == [{"row": 0}, {"row": 1}, {"row": 2}]  # what it had written
        assert report["failures"] == ["hang: interrupted (SIGTERM)"]
    finally:
        proc.kill()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_out_defaults_outside_the_repository(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    out = gpu_check.default_out()
    assert out.parent == tmp_path / "megaflex" / "gpu_check" and REPO not in out.parents


def test_accuracy_judge_lists_the_dtypes_own_overflow_and_fails_the_kernels():
    from benchmarks.gpu_check.accuracy import judge

    inf, nan = float("inf"), float("nan")
    assert judge({"out": 1e-4, "dq": inf}, {"out": 0.0, "dq": inf}, 1e-3) == {"passed": True, "overflows_in_dtype": ["dq"]}
    assert judge({"out": 1e-4, "dq": inf}, {"out": 0.0, "dq": 1.0}, 1e-3) == {"passed": False}  # only the kernel overflows
    assert judge({"out": nan}, {"out": 1e-3}, 1.0) == {"passed": False}
    assert judge({"out": 2e-3}, {"out": 1e-4}, 1e-3) == {"passed": True}  # within tolerance + 10x the reference's
    assert judge({"out": 3e-3}, {"out": 1e-4}, 1e-3) == {"passed": False}


def test_map_in_workers_returns_every_item_and_a_dead_worker_as_an_error():
    from benchmarks.gpu_check.common import map_in_workers

    assert dict(map_in_workers(gpu_check_stubs.square_or_die, [1, 2, 3], workers=1)) == {0: {"x": 1}, 1: {"x": 4}, 2: {"x": 9}}
    got = dict(map_in_workers(gpu_check_stubs.square_or_die, [2, -1], workers=2))
    assert set(got) == {0, 1} and "worker failed" in got[1]["error"]
    # a pool that broke may take a neighbour still running along: then that one is an error too
    assert got[0] == {"x": 4} or "worker failed" in got[0]["error"]


def test_an_error_raised_inside_fla_is_its_refusal_not_a_megaflex_failure(tmp_path):
    from benchmarks.gpu_check.stages_kernels import raised_inside_package

    fake = tmp_path / "fla" / "ops.py"
    fake.parent.mkdir()
    fake.write_text("def run():\n    raise RuntimeError('Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs ...')\n")
    namespace: dict = {}
    exec(compile(fake.read_text(), str(fake), "exec"), namespace)
    try:
        namespace["run"]()
    except RuntimeError as err:
        assert raised_inside_package(err, "fla")
    try:
        raise ValueError("megaflex's own")
    except ValueError as err:
        assert not raised_inside_package(err, "fla")
