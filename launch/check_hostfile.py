"""Validate a DeepSpeed hostfile before launching: format, slots, and (optionally) ssh reachability.

    python launch/check_hostfile.py HOSTFILE [--ssh]
    python launch/check_hostfile.py HOSTFILE --node-rank R --gpus 4,5,6,7 --local-hostfile OUT

Exit 0 and print "<nodes> nodes, <slots> slots" when fine; exit 2 with a message naming the
line and what is expected otherwise. ``--ssh`` also checks every host answers ``ssh host true``
within 10 s (what the deepspeed launcher will need).

``--node-rank/--gpus/--local-hostfile`` (launch/train.sh, one launcher per node under Slurm): the
deepspeed launcher gives node R's ranks the GPUs 0..slots-1, over the GPUs Slurm allocated
(CUDA_VISIBLE_DEVICES, e.g. 4-7 on a shared node). Writes OUT, HOSTFILE with node R's slots raised
to cover those ids, and prints the ``--include`` that names them for node R (every slot of the
others, whose own launchers name theirs); refuses GPUs fewer or more than node R's slots, which
every node's launcher must count alike.
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


def slurm_include(hosts: list[tuple[str, int]], node_rank: int, gpus: str) -> tuple[str, list[tuple[str, int]]]:
    """(deepspeed ``--include`` value, node-local hosts) giving node ``node_rank`` the GPU ids ``gpus``
    ("4,5,6,7"); raises ValueError when they are not indices or not as many as its slots."""
    if not 0 <= node_rank < len(hosts):
        raise ValueError(f"node rank {node_rank} but the hostfile lists {len(hosts)} hosts")
    ids = [g.strip() for g in gpus.split(",") if g.strip()]
    if not ids or not all(g.isdigit() for g in ids):
        raise ValueError(f"GPUs {gpus!r} (CUDA_VISIBLE_DEVICES / SLURM_STEP_GPUS): the deepspeed launcher takes GPU indices")
    host, slots = hosts[node_rank]
    if len(ids) != slots:
        raise ValueError(f"Slurm gives this node ({host}) {len(ids)} GPUs ({gpus}) but the hostfile {slots} slots; every "
                         "node's launcher counts ranks from the slots: make them equal (sbatch --gpus-per-node)")
    local = [(h, max(s, max(int(g) for g in ids) + 1) if i == node_rank else s) for i, (h, s) in enumerate(hosts)]
    include = "@".join(f"{h}:{','.join(ids)}" if i == node_rank else h for i, (h, _) in enumerate(hosts))
    return include, local


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
    ap.add_argument("--node-rank", type=int, help="this node's index in the hostfile (with --gpus)")
    ap.add_argument("--gpus", help="the GPU ids Slurm gave this node, e.g. 4,5,6,7 (with --node-rank)")
    ap.add_argument("--local-hostfile", help="where to write this node's hostfile (with --gpus)")
    args = ap.parse_args()
    try:
        hosts = parse_hostfile(args.hostfile)
        if args.gpus is not None:
            include, local = slurm_include(hosts, args.node_rank or 0, args.gpus)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.gpus is not None:
        with open(args.local_hostfile, "w") as f:
            f.writelines(f"{host} slots={slots}\n" for host, slots in local)
        print(include)
        return 0
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
