"""Stand-in gpu_check stages for tests/benchmarks/test_eval_gpu_check.py (not a test module): stages that
finish, catch a failure, or write rows and then hang with a child process of their own.

``python -m tests.helpers.gpu_check_stubs ARGS``: ``python -m benchmarks.gpu_check ARGS`` with these stages
in place of the real ones (for tests that signal the parent process)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from benchmarks.gpu_check.__main__ import StageSpec

HERE = "tests.helpers.gpu_check_stubs"


def ok(stage: Any) -> dict[str, Any]:
    """Passes; reports the Triton cache it was given and the one a trainer it started would use."""
    from benchmarks.gpu_check.common import trainer_env

    return {"passed": True, "cases": [{"dtype": "bf16", "passed": True}],
            "triton_cache_dir": __import__("os").environ.get("TRITON_CACHE_DIR"),
            "trainer_triton_cache_dir": trainer_env(True).get("TRITON_CACHE_DIR")}  # fmt: skip


def caught_failure(stage: Any) -> dict[str, Any]:
    """Finishes (exit 0) but caught failures of its own, one nested in a list."""
    return {"trainer": {"error": "exit 1: boom"}, "cases": [{"dtype": "fp32", "passed": True},
                                                            {"dtype": "bf16", "passed": False, "max_error": 0.5}]}  # fmt: skip


def rows_then_hang(stage: Any) -> dict[str, Any]:
    """Starts a child (a trainer stand-in), records both pids, writes three rows, then hangs."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    result: dict[str, Any] = {"rows": []}
    for i in range(3):
        result["rows"].append({"row": i})
        stage.emit(result)
    tmp = stage.work_dir / "pids.tmp"
    tmp.write_text(json.dumps({"stage": __import__("os").getpid(), "child": child.pid}))
    tmp.replace(stage.work_dir / "pids.json")  # after the rows: once it exists, they are written
    time.sleep(600)
    return result


def square_or_die(x: int) -> dict[str, Any]:
    """A case function for ``map_in_workers``: x * x, or its worker process dies for x < 0."""
    if x < 0:
        __import__("os")._exit(3)
    return {"x": x * x}


def stages(**timeouts: float) -> dict[str, StageSpec]:
    """name -> StageSpec of the stubs (needs 1 s; dry-run timeout per stage, default 300 s)."""
    targets = {"quick": "ok", "caught": "caught_failure", "hang": "rows_then_hang", "late": "ok"}
    return {name: StageSpec(f"{HERE}:{fn}", 1, 300, 1, timeouts.get(name, 300)) for name, fn in targets.items()}


if __name__ == "__main__":
    import benchmarks.gpu_check.__main__ as gpu_check

    gpu_check.STAGES = stages()
    sys.exit(gpu_check.main(sys.argv[1:]))
