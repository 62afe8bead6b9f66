"""What every user error of a megaflex command looks like: exactly one ``PROG: ... error: ...``
line on stderr and no traceback (progress bars and warnings may surround it)."""

from __future__ import annotations


def one_error_line(stderr: str, prog: str) -> str:
    """The single error line of ``prog`` in ``stderr`` (asserting there is one and no traceback)."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line.strip() for line in stderr.replace("\r", "\n").splitlines()]
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1, f"expected one error line, got {errors}:\n{stderr[-3000:]}"
    assert errors[0].startswith(f"{prog}: ") and "error: " in errors[0], errors[0]
    return errors[0]
