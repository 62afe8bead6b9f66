"""megaflex.parallel.comm: the one way to talk to other ranks with tensors.

* The rule on the sources: no torch.distributed tensor (or object) collective is called outside
  ``megaflex/parallel/`` (NCCL takes CUDA tensors only; ``comm`` stages them on the right device).
* The communication device follows the backend (NCCL -> CUDA, gloo -> CPU).
* The collectives themselves on two gloo ranks, and a TP = CP = 1 grid builds no group of one rank.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megaflex.parallel import comm
from distributed import run_distributed

REPO = Path(__file__).resolve().parents[2]
CHECKED = ("megaflex", "benchmarks", "studies", "data_prep")
ALLOWED = REPO / "megaflex" / "parallel"
COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
    "_all_gather_base", "all_gather_object", "broadcast", "broadcast_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "gather", "gather_object", "scatter", "scatter_object_list",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
    "recv_object_list",
})


def collective_calls(source: str, filename: str = "<source>") -> list[str]:
    """``file:line name`` of every torch.distributed collective called in ``source``, however
    torch.distributed was imported (``import torch.distributed as dist``, ``from torch import
    distributed``, ``from torch.distributed import all_reduce``, ``torch.distributed.all_reduce``)."""
    tree = ast.parse(source, filename)
    modules: set[str] = set()  # local names bound to torch.distributed
    functions: dict[str, str] = {}  # local name -> collective imported by name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch.distributed" and alias.asname:
                    modules.add(alias.asname)
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if node.module == "torch" and alias.name == "distributed":
                    modules.add(alias.asname or "distributed")
                elif node.module == "torch.distributed" and alias.name in COLLECTIVES:
                    functions[alias.asname or alias.name] = alias.name
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f, name = node.func, None
        if isinstance(f, ast.Name) and f.id in functions:
            name = functions[f.id]
        elif isinstance(f, ast.Attribute) and f.attr in COLLECTIVES:
            owner = ast.unparse(f.value)
            if owner in modules or owner == "torch.distributed":
                name = f.attr
        if name is not None:
            found.append(f"{filename}:{node.lineno} {name}")
    return found


def test_checker_finds_every_import_form() -> None:
    source = (
        "import torch\nimport torch.distributed as dist\nfrom torch import distributed as d2\n"
        "from torch.distributed import all_gather as ag, barrier\n"
        "dist.all_reduce(t)\ntorch.distributed.broadcast(t, 0)\nd2.all_to_all_single(a, b)\nag(parts, t)\n"
        "dist.barrier()\nbarrier()\ndist.get_rank()\nother.all_reduce(t)\n"
    )
    assert collective_calls(source) == [
        "<source>:5 all_reduce", "<source>:6 broadcast", "<source>:7 all_to_all_single", "<source>:8 all_gather",
    ]


def test_no_tensor_collective_outside_megaflex_parallel() -> None:
    offenders, checked = [], 0
    for top in CHECKED:
        for path in sorted((REPO / top).rglob("*.py")):
            if ALLOWED in path.parents:
                continue
            checked += 1
            offenders += collective_calls(path.read_text(), str(path.relative_to(REPO)))
    assert checked > 50  # the walk really saw the sources
    assert not offenders, "call megaflex.parallel.comm instead of torch.distributed here:\n" + "\n".join(offenders)


@pytest.mark.parametrize("backend, device", [
    ("nccl", "cuda"), ("gloo", "cpu"), ("mpi", "cpu"), ("NCCL", "cuda"), ("cpu:gloo,cuda:nccl", "cpu"),
])
def test_communication_device_follows_the_backend(backend: str, device: str) -> None:
    assert comm.device_for_backend(backend).type == device


def test_without_a_process_group_everything_is_local() -> None:
    t = torch.tensor([1.0, 2.0])
    assert comm.world_group() is None and comm.group_size(None) == 1
    assert comm.all_reduce(t, "sum", None) is t and torch.equal(t, torch.tensor([1.0, 2.0]))
    assert comm.any_rank(True) and not comm.any_rank(torch.tensor(0.0))
    assert comm.all_gather(t).shape == (1, 2) and comm.all_gather_objects({"a": 1}) == [{"a": 1}]
    assert comm.communication_device().type == "cpu"


def _collectives_worker(rank: int, world: int) -> dict:
    from megaflex.parallel import ParallelState

    group = comm.world_group()
    assert comm.communication_device(group).type == "cpu"  # gloo
    total = comm.all_reduce(torch.tensor([float(rank + 1)], dtype=torch.float64), "sum", group)
    biggest = comm.all_reduce(torch.tensor(float(rank)), "max", group)
    saved = torch.tensor([2.0 * rank])
    copy = comm.reduced(saved, "sum", group)
    flags = (comm.any_rank(rank == 1, group), comm.any_rank(False, group), comm.any_rank(torch.tensor(rank == 0), group))
    sent = comm.broadcast(torch.tensor([rank + 10]), src=1, group=group)
    gathered = comm.all_gather(torch.tensor([rank, -rank]), group)
    objects = comm.all_gather_objects({"rank": rank}, group)

    # TP = CP = 1 on two ranks: one group (DP = DP x CP = both ranks), none of one rank.
    made: list[list[int]] = []
    real_new_group = dist.new_group

    def counting_new_group(ranks=None, *args, **kwargs):
        made.append(list(ranks))
        return real_new_group(ranks, *args, **kwargs)

    dist.new_group = counting_new_group
    try:
        state = ParallelState.create(tensor_parallel_size=1)
    finally:
        dist.new_group = real_new_group
    assert state.tp_group is None and state.cp_group is None and state.mp_group is None and state.has_groups
    dp_sum = comm.all_reduce(torch.tensor(1.0), "sum", state.dp_group)
    tp_sum = comm.all_reduce(torch.tensor(1.0), "sum", state.tp_group)  # alone: untouched
    return {
        "total": total.item(), "max": biggest.item(), "saved": saved.item(), "copy": copy.item(), "flags": flags,
        "sent": sent.item(), "gathered": gathered.tolist(), "objects": objects, "made": made,
        "dp_sum": dp_sum.item(), "tp_sum": tp_sum.item(), "same_dp_group": state.dp_group is state.dp_cp_group,
    }


@pytest.mark.slow
def test_collectives_and_no_singleton_groups_on_two_gloo_ranks() -> None:
    for rank, r in enumerate(run_distributed(_collectives_worker, 2)):
        assert r["total"] == 3.0 and r["max"] == 1.0
        assert r["saved"] == 2.0 * rank and r["copy"] == 2.0  # reduced() leaves its input alone
        assert r["flags"] == (True, False, True)
        assert r["sent"] == 11 and r["gathered"] == [[0, 0], [1, -1]]
        assert r["objects"] == [{"rank": 0}, {"rank": 1}]
        assert r["made"] == [[0, 1]], r["made"]  # was 4W + 2 = 10 groups, 8 of them of one rank
        assert r["dp_sum"] == 2.0 and r["tp_sum"] == 1.0 and r["same_dp_group"]
