"""``python -m benchmarks.gpu_check``: run the stages (see the package docstring), each in a subprocess
(its own process group) under one global deadline, and rewrite ``<out>/gpu_check.json`` after every
stage. Exit status (``report.exit_status``): 0 when every stage ran to its end and nothing in it
failed; 1 when something ran and was wrong (a stage that crashed or hung past its own timeout, or a
failure a stage caught itself); 3 when nothing failed but a stage was skipped or cut at the global
deadline (*not run (time)*: incomplete, not broken); 2 without a usable GPU (not a dry run);
128 + the signal on SIGINT / SIGTERM."""

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu_check.common import REPO, Stage, log_tail
from megaflex.cli_args import positive_float, scratch_results
from benchmarks.gpu_check.report import NOT_RUN_TIME, exit_status, stage_failures, stages_not_run


@dataclass(frozen=True)
class StageSpec:
    """A stage: ``module:function`` (under benchmarks.gpu_check unless dotted), the seconds it needs
    on one GPU with a cold Triton cache (it is skipped when less is left before the deadline) and
    its own timeout there, and the same two on a dry run (CPU)."""

    target: str
    gpu_needs_s: float
    gpu_timeout_s: float
    dry_needs_s: float
    dry_timeout_s: float


# Most valuable first: whether the real trainer runs at the production shape (and resumes), then
# whether the compiled kernels are right, then the speed comparisons and precision. The GPU "needs"
# are the first H200 run's cold-cache seconds (docs/results/gpu_check_h200) plus ~25%, each stage's
# own Triton compiles included (stages share the cache but few kernels: kernel_accuracy's head counts
# and kernel_sweep's shapes specialise differently from the trainer's). They sum to 595 s, over the
# 540 s default deadline: a run as slow as the estimates leaves the last stage *not run (time)*
# (exit 3); the first run took 447 s, kernel_sweep cut at its then 150 s timeout.
STAGES: dict[str, StageSpec] = {
    "environment": StageSpec("stages_env:environment", 15, 60, 30, 300),
    "trainer_247m": StageSpec("stages_train:trainer_247m", 130, 240, 120, 900),
    "kernel_accuracy": StageSpec("stages_kernels:kernel_accuracy", 45, 150, 60, 600),
    "softmax_247m": StageSpec("stages_train:softmax_247m", 45, 90, 60, 600),
    "kernel_sweep": StageSpec("stages_kernels:kernel_sweep", 200, 300, 60, 600),
    "precision_41m": StageSpec("stages_train:precision_41m", 105, 150, 120, 900),
    "window_kernels": StageSpec("stages_window:window_kernels", 55, 120, 60, 600),
}
DEFAULT_DEADLINE_S = {False: 540.0, True: 3600.0}  # one GPU (a 10-minute call with set-up); a dry run on loaded CPUs


class Interrupted(Exception):
    """SIGINT or SIGTERM while a stage runs (SIGINT too: a shell's background job ignores it by
    default, which would leave the stages running)."""


def _raise_interrupted(signum: int, _frame: Any) -> None:
    raise Interrupted(signum)


def run_stage(target: str, dry_run: bool, work: Path, result: Path, options: dict[str, Any]) -> None:
    """In the stage's own process: run it and write its result (partial results as it goes)."""
    module, function = target.split(":")
    module = module if "." in module else f"benchmarks.gpu_check.{module}"
    stage = Stage(dry_run=dry_run, work_dir=work, result_path=result, options=options)
    stage.emit(getattr(importlib.import_module(module), function)(stage))


def _kill_group(proc: Any) -> None:
    """The stage and every process it started (trainers): they share its process group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _spawn(name: str, args: argparse.Namespace, work: Path, report_path: Path, timeout: float, env: dict[str, str],
           cut_at_deadline: bool = False) -> dict[str, Any]:
    """One stage in a subprocess in its own session under ``timeout`` (its whole process group is
    killed past it, or when this process is interrupted); ``cut_at_deadline``: ``timeout`` is what
    was left before the global deadline, not the stage's own timeout."""
    result_path = work / f"{name}.result.json"
    result_path.unlink(missing_ok=True)
    options = {"deadline": time.time() + timeout, "timeout_scale": args.timeout_scale}
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--run-stage", name, "--target", STAGES[name].target,
           "--result", str(result_path), "--work-dir", str(work / name), "--report", str(report_path),
           "--options", json.dumps(options)]  # fmt: skip
    if args.dry_run:
        cmd.append("--dry-run")
    (work / name).mkdir(parents=True, exist_ok=True)
    log_path = work / f"{name}.log"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
            status = "ok" if returncode == 0 else f"crashed (exit {returncode})"
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            # cut by the global deadline (it had less than its own timeout left): incomplete, not a hang
            status = (f"{NOT_RUN_TIME}: cut at the deadline after {timeout:.0f} s" if cut_at_deadline
                      else f"timed out after {timeout:.0f} s")  # fmt: skip
        except BaseException:  # Ctrl-C, SIGTERM: the stage's group goes with this process
            _kill_group(proc)
            raise
    result = _read_result(result_path)  # a killed stage keeps what it emitted
    result["stage_status"] = status
    result["seconds"] = round(time.perf_counter() - start, 1)
    if stage_failures(name, result):
        result["log_tail"] = log_tail(log_path, 3000)
    return result


def _read_result(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _stage_env(args: argparse.Namespace, cache: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # one Triton cache for every stage and the trainers they start (launcher_env keeps a set one)
    env["TRITON_CACHE_DIR"] = str(cache)
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"  # CPU tensors: the kernels run in Triton's interpreter
    return env


def default_out() -> Path:
    """A new folder outside the repository: $XDG_CACHE_HOME (or ~/.cache)/megaflex/gpu_check/<time>."""
    return scratch_results("gpu_check") / time.strftime("%Y%m%d-%H%M%S")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="GPU acceptance of megaflex in one call (see benchmarks/gpu_check/__init__.py)")
    ap.add_argument("--dry-run", action="store_true", help="every stage at tiny shapes on CPU (Triton interpreter)")
    ap.add_argument("--out", type=Path, default=None, help="report folder (default: a new folder under "
                    "$XDG_CACHE_HOME/megaflex/gpu_check, outside the repository)")  # fmt: skip
    ap.add_argument("--stages", nargs="+", choices=list(STAGES), default=list(STAGES))
    ap.add_argument("--deadline", type=positive_float, default=None, help="seconds for the whole run (default 540; a dry run "
                    "3600): a stage that needs more than is left is skipped, the running one is cut at it")  # fmt: skip
    ap.add_argument("--work-dir", type=Path, default=None, help="run directories and checkpoints (default: a temporary folder)")
    ap.add_argument("--triton-cache", type=Path, default=None, help="TRITON_CACHE_DIR of every stage and trainer "
                    "(default: $TRITON_CACHE_DIR, else the trainer's node-local one for local rank 0)")  # fmt: skip
    ap.add_argument("--timeout-scale", type=positive_float, default=1.0, help="multiply every stage's timeout and need, and "
                    "the trainer timeouts inside stages (the deadline still holds)")  # fmt: skip
    ap.add_argument("--run-stage", help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.stages = [name for name in STAGES if name in args.stages]  # most valuable first, whatever the order given
    if args.deadline is None:
        args.deadline = DEFAULT_DEADLINE_S[args.dry_run]
    return args


def _write(report_path: Path, report: dict[str, Any]) -> None:
    tmp = report_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(report_path)


def _run_all(args: argparse.Namespace, report: dict[str, Any], report_path: Path, work: Path, env: dict[str, str]) -> None:
    """The stages in order, each under min(its timeout, the time left); skipped when it needs more."""
    end = time.monotonic() + args.deadline
    for name in args.stages:
        spec = STAGES[name]
        needs = (spec.dry_needs_s if args.dry_run else spec.gpu_needs_s) * args.timeout_scale
        own = (spec.dry_timeout_s if args.dry_run else spec.gpu_timeout_s) * args.timeout_scale
        left = end - time.monotonic()
        if left < needs:
            result: dict[str, Any] = {"stage_status": f"{NOT_RUN_TIME}: skipped, needs ~{needs:.0f} s, "
                                      f"{max(left, 0):.0f} s left of the {args.deadline:.0f} s deadline",
                                      "seconds": 0.0}  # fmt: skip
        else:
            report["running"] = name
            _write(report_path, report)
            result = _spawn(name, args, work, report_path, min(own, left), env, cut_at_deadline=left < own)
            del report["running"]
        report["stages"][name] = result
        _write(report_path, report)
        print(f"[gpu_check] {name}: {result['stage_status']} in {result['seconds']} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.run_stage:  # inside a stage's subprocess
        previous = json.loads(args.report.read_text()).get("stages", {}) if args.report and args.report.exists() else {}
        run_stage(args.target or STAGES[args.run_stage].target, args.dry_run, args.work_dir, args.result,
                  {"previous": previous, **json.loads(args.options)})  # fmt: skip
        return 0
    if not args.dry_run:
        from megaflex.parallel.launcher_env import cuda_unusable_reason

        reason = cuda_unusable_reason()
        if reason is not None:
            print(f"error: no usable CUDA device ({reason}); run on a GPU, or pass --dry-run for the tiny CPU run",
                  file=sys.stderr)  # fmt: skip
            return 2
    from megaflex.parallel.launcher_env import triton_cache_dir

    out = args.out or default_out()
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / "gpu_check.json"
    cache = args.triton_cache or Path(os.environ.get("TRITON_CACHE_DIR") or triton_cache_dir({**os.environ, "LOCAL_RANK": "0"}))
    cache.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"dry_run": args.dry_run, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                              "deadline_s": args.deadline, "triton_cache_dir": str(cache),
                              "triton_cache_entries_at_start": sum(1 for _ in cache.iterdir()), "stages": {}}  # fmt: skip
    print(f"[gpu_check] report: {report_path} (deadline {args.deadline:.0f} s)", flush=True)
    status = 0
    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="gpu_check_work_") as tmp:
            work = args.work_dir or Path(tmp)
            try:
                _run_all(args, report, report_path, work, _stage_env(args, cache))
            except (KeyboardInterrupt, Interrupted) as err:
                signame = signal.Signals(err.args[0] if isinstance(err, Interrupted) else signal.SIGINT)
                running = report.pop("running", None)
                report["interrupted"] = f"{signame.name} during {running or 'no stage'}"
                if running:  # what it had written, as after a timeout
                    report["stages"][running] = {**_read_result(work / f"{running}.result.json"),
                                                 "stage_status": f"interrupted ({signame.name})"}  # fmt: skip
                status = 128 + int(signame)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    report["seconds"] = round(time.monotonic() - start, 1)
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    report["failures"] = [line for name, r in report["stages"].items() for line in stage_failures(name, r)]
    report["not_run_time"] = stages_not_run(report["stages"])
    report["verdict"] = {0: "passed", 1: "failed", 3: "incomplete"}[exit_status(report)]
    _write(report_path, report)
    if report.get("interrupted"):
        print(f"[gpu_check] interrupted: {report['interrupted']}", file=sys.stderr)
    for line in report["failures"]:
        print(f"[gpu_check] FAILED {line}", file=sys.stderr)
    for name in report["not_run_time"]:
        print(f"[gpu_check] NOT RUN (time) {name}: {report['stages'][name]['stage_status']}", file=sys.stderr)
    print(f"[gpu_check] {report['verdict']}: {len(report['failures'])} failure(s), {len(report['not_run_time'])} "
          f"stage(s) not run for time, in {report['seconds']} s; report: {report_path}", flush=True)  # fmt: skip
    return status or exit_status(report)


if __name__ == "__main__":
    sys.exit(main())
