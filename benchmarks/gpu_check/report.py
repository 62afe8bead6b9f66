"""What counts as a failure in a gpu_check report, and the console lines that name them.

A stage fails when its process crashed or hung past its own timeout, and also when it caught a
failure itself: any ``"error"`` field (a trainer crash, a failed resume, a kernel that raised) or
``"passed": False`` (an accuracy case, the int32 probe, ``pip check``), at any depth of its result
(a stage cut at the deadline still fails on the rows it wrote). A stage skipped for lack of time, or
cut at the global deadline, is *not run (time)*: not a failure, but the run is incomplete (exit 3),
so a correct but slow first run never reads like a broken one.
"""

from __future__ import annotations

from typing import Any

# fields that name a row of a list (a case, a run) in a failure's path
_LABEL_KEYS = ("impl", "dtype", "n", "N", "normalization", "state", "paired", "shape", "F", "Dv", "name")


def _label(row: dict[str, Any], index: int) -> str:
    parts = [f"{k}={row[k]}" for k in _LABEL_KEYS if k in row and not isinstance(row[k], (dict, list))]
    return f"[{index}]" + (f"({' '.join(parts)})" if parts else "")


def _short(value: Any, limit: int = 300) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def caught_failures(result: Any, path: str = "") -> list[str]:
    """``path: why`` for every ``error`` field and ``passed: False`` in ``result``, nested ones too
    (``why`` alone at the top level)."""
    return [f"{where}: {why}" if where else why for where, why in _walk(result, path)]


def _walk(result: Any, path: str) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    if isinstance(result, dict):
        if result.get("error"):
            found.append((path, f"error: {_short(result['error'])}"))
        if result.get("passed") is False:
            extra = f" (max_error {result['max_error']:.3g})" if isinstance(result.get("max_error"), float) else ""
            found.append((path, f"passed=False{extra}"))
        for key, value in result.items():
            if key not in ("error", "log_tail") and isinstance(value, (dict, list)):
                found += _walk(value, f"{path}.{key}" if path else key)
    elif isinstance(result, list):
        for i, value in enumerate(result):
            found += _walk(value, path + (_label(value, i) if isinstance(value, dict) else f"[{i}]"))
    return found


NOT_RUN_TIME = "not run (time)"  # the stage_status prefix of a stage skipped or cut for the deadline


def not_run_for_time(result: dict[str, Any]) -> bool:
    return str(result.get("stage_status", "")).startswith(NOT_RUN_TIME)


def stages_not_run(stages: dict[str, dict[str, Any]]) -> list[str]:
    """The stages skipped or cut for lack of time, in order."""
    return [name for name, result in stages.items() if not_run_for_time(result)]


def exit_status(report: dict[str, Any]) -> int:
    """1 when anything failed, else 3 when a stage was not run (time), else 0."""
    stages = report.get("stages", {})
    if any(stage_failures(name, r) for name, r in stages.items()):
        return 1
    return 3 if stages_not_run(stages) else 0


def stage_failures(name: str, result: dict[str, Any]) -> list[str]:
    """The stage's own status when it crashed or hung (not when it was not run for time), then the
    failures it caught, ``name/...``."""
    status = result.get("stage_status")
    found = [] if status == "ok" or not_run_for_time(result) else [f"{name}: {status}"]
    inner = {k: v for k, v in result.items() if k not in ("stage_status", "log_tail", "seconds")}
    return found + [f"{name}/{where}: {why}" if where else f"{name}: {why}" for where, why in _walk(inner, "")]
