"""``python -m evaluation.gpu_check``: run the stages (see the package docstring), each in a subprocess
with its own timeout, and rewrite ``<out>/gpu_check.json`` after every stage."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from evaluation.gpu_check.common import REPO, Stage

# name -> (module:function, timeout on a GPU in s, timeout on a dry run in s); most telling first
STAGES: dict[str, tuple[str, int, int]] = {
    "environment": ("stages_env:environment", 120, 300),
    "trainer_247m": ("stages_train:trainer_247m", 480, 900),
    "softmax_247m": ("stages_train:softmax_247m", 180, 600),
    "kernel_sweep": ("stages_kernels:kernel_sweep", 240, 600),
    "precision_41m": ("stages_train:precision_41m", 420, 900),
    "kernel_accuracy": ("stages_kernels:kernel_accuracy", 180, 900),
    "window_kernels": ("stages_window:window_kernels", 240, 600),
}


def run_stage(name: str, dry_run: bool, work: Path, result: Path, options: dict[str, Any]) -> None:
    """In the stage's own process: run it and write its result (partial results as it goes)."""
    module, function = STAGES[name][0].split(":")
    stage = Stage(dry_run=dry_run, work_dir=work, result_path=result, options=options)
    fn = getattr(importlib.import_module(f"evaluation.gpu_check.{module}"), function)
    stage.emit(fn(stage))


def _spawn(name: str, args: argparse.Namespace, work: Path, report_path: Path) -> dict[str, Any]:
    """One stage in a subprocess under its timeout (its whole process group is killed past it)."""
    result_path = work / f"{name}.result.json"
    result_path.unlink(missing_ok=True)
    timeout = STAGES[name][2 if args.dry_run else 1] * args.timeout_scale
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"  # CPU tensors: the kernels run in Triton's interpreter
    cmd = [sys.executable, "-m", "evaluation.gpu_check", "--run-stage", name, "--result", str(result_path),
           "--work-dir", str(work / name), "--report", str(report_path)]  # fmt: skip
    if args.dry_run:
        cmd.append("--dry-run")
    (work / name).mkdir(parents=True, exist_ok=True)
    log = open(work / f"{name}.log", "w+")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        returncode = proc.wait(timeout=timeout)
        status = "ok" if returncode == 0 else f"crashed (exit {returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the stage and the trainer processes it started
        proc.wait()
        status = f"timed out after {timeout:.0f} s"
    log.seek(0)
    tail = log.read()[-3000:]
    log.close()
    try:
        result = json.loads(result_path.read_text())
    except (OSError, json.JSONDecodeError):
        result = {}
    result["stage_status"] = status
    result["seconds"] = round(time.perf_counter() - start, 1)
    if status != "ok":
        result["log_tail"] = tail
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="GPU acceptance of megaflex in one call (see evaluation/gpu_check/__init__.py)")
    ap.add_argument("--dry-run", action="store_true", help="every stage at tiny shapes on CPU (Triton interpreter)")
    ap.add_argument("--out", type=Path, default=None, help="report folder (default docs/results/gpu_check; "
                    "a dry run: a temporary folder)")  # fmt: skip
    ap.add_argument("--stages", nargs="+", choices=list(STAGES), default=list(STAGES))
    ap.add_argument("--work-dir", type=Path, default=None, help="run directories and checkpoints (default: a temporary folder)")
    ap.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every stage's timeout")
    ap.add_argument("--run-stage", choices=list(STAGES), help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run_stage:  # inside a stage's subprocess
        previous = json.loads(args.report.read_text()).get("stages", {}) if args.report and args.report.exists() else {}
        run_stage(args.run_stage, args.dry_run, args.work_dir, args.result,
                  {"previous": previous})  # fmt: skip
        return 0
    if not args.dry_run:
        from megaflex.parallel.launcher_env import cuda_unusable_reason

        reason = cuda_unusable_reason()
        if reason is not None:
            print(f"error: no usable CUDA device ({reason}); run on a GPU, or pass --dry-run for the tiny CPU run",
                  file=sys.stderr)  # fmt: skip
            return 2
    out = args.out or (Path(tempfile.mkdtemp(prefix="gpu_check_dry_")) if args.dry_run else REPO / "docs" / "results" / "gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / "gpu_check.json"
    report: dict[str, Any] = {"dry_run": args.dry_run, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "stages": {}}
    with tempfile.TemporaryDirectory(prefix="gpu_check_work_") as tmp:
        work = args.work_dir or Path(tmp)
        for name in args.stages:
            report_path.write_text(json.dumps(report, indent=1, default=str))
            result = _spawn(name, args, work, report_path)
            report["stages"][name] = result
            report_path.write_text(json.dumps(report, indent=1, default=str))
            print(f"[gpu_check] {name}: {result['stage_status']} in {result['seconds']} s"
                  + (f" ({str(result['error'])[:200]})" if "error" in result else ""), flush=True)  # fmt: skip
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    report_path.write_text(json.dumps(report, indent=1, default=str))
    print(f"[gpu_check] report: {report_path}")
    return 0 if all(r["stage_status"] == "ok" for r in report["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
