"""Validate a DeepSpeed hostfile before launching: format, slots, and (optionally) ssh reachability.

    python launch/check_hostfile.py HOSTFILE [--ssh]

Exit 0 and print "<nodes> nodes, <slots> slots" when fine; exit 2 with a message naming the
line and what is expected otherwise. ``--ssh`` also checks every host answers ``ssh host true``
within 10 s (what the deepspeed launcher will need).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

LINE_RE = re.compile(r"^(?P<host>[A-Za-z0-9_.\-]+)\s+slots=(?P<slots>\d+)\s*$")


def parse_hostfile(path: str) -> list[tuple[str, int]]:
    """[(host, slots)]; raises ValueError naming the file, line and expected format."""
    try:
        lines = open(path).read().splitlines()
    except OSError as e:
        raise ValueError(f"hostfile {path}: cannot be read ({e.strerror})") from e
    hosts: list[tuple[str, int]] = []
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = LINE_RE.match(line)
        if not m:
            raise ValueError(f"hostfile {path} line {number}: expected '<hostname> slots=<N>', got {raw!r}")
        host, slots = m["host"], int(m["slots"])
        if slots < 1:
            raise ValueError(f"hostfile {path} line {number}: expected slots >= 1, got {slots}")
        if host in dict(hosts):
            raise ValueError(f"hostfile {path} line {number}: host {host!r} is listed twice")
        hosts.append((host, slots))
    if not hosts:
        raise ValueError(f"hostfile {path}: no hosts (expected lines '<hostname> slots=<N>')")
    return hosts


def unreachable(hosts: list[tuple[str, int]]) -> list[str]:
    """Hosts that do not answer ``ssh -o BatchMode=yes host true`` within 10 s."""
    bad = []
    for host, _ in hosts:
        cmd = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", host, "true"]
        try:
            ok = subprocess.run(cmd, capture_output=True, timeout=20).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if not ok:
            bad.append(host)
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hostfile")
    ap.add_argument("--ssh", action="store_true", help="also check passwordless ssh to every host")
    args = ap.parse_args()
    try:
        hosts = parse_hostfile(args.hostfile)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.ssh:
        bad = unreachable(hosts)
        if bad:
            print(
                f"error: hosts not reachable by passwordless ssh: {', '.join(bad)} "
                "(the deepspeed launcher needs it; or launch one process per node with --no_ssh / Slurm)",
                file=sys.stderr,
            )
            return 2
    print(f"{len(hosts)} nodes, {sum(s for _, s in hosts)} slots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
