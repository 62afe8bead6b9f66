"""docs/training.md "Layouts": each documented multi-node layout is a valid run on its world (the
config validation a launch does first) and its per-GPU figure is the memory plan's; README names
every layout's overrides. No launch: the layouts need 32 ranks; test_launch_docs.py runs the
launch line itself on 2 CPU ranks."""

from __future__ import annotations

import re

import pytest

from megaflex.model.memory_plan import GIB, memory_plan
from megaflex.training.config import load_config, parallel_dims, validate_runtime
from training_harness import REPO

ROW = re.compile(r"^\| (?P<name>[^|]+) \| (?P<nodes>\d+) x (?P<gpus>\d+) \| `(?P<args>[^`]+)` \| (?P<gib>[\d.]+) \|$")


def documented_layouts() -> list[dict[str, str]]:
    text = (REPO / "docs" / "training.md").read_text()
    section = text.split("## Layouts", 1)[1].split("\n## ", 1)[0]
    return [m.groupdict() for line in section.splitlines() if (m := ROW.match(line))]


LAYOUTS = documented_layouts()


def test_the_layouts_cover_tp_cp_pp_and_sp() -> None:
    names = [layout["name"] for layout in LAYOUTS]
    for axis in ("TP", "CP", "PP", "SP", "ZeRO-3"):
        assert any(axis in name for name in names), (axis, names)
    assert any("PP" in n and "SP" in n for n in names) and any("CP" in n and "SP" in n for n in names)


@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout["name"] for layout in LAYOUTS])
def test_documented_layout_validates_on_its_world_and_matches_the_memory_plan(layout: dict[str, str]) -> None:
    args = layout["args"].split()
    files = [a for a in args if a.endswith(".yaml")]
    overrides = [a for a in args if not a.endswith(".yaml")]
    world = int(layout["nodes"]) * int(layout["gpus"])
    cfg = load_config([str(REPO / f) for f in files], overrides)
    validate_runtime(cfg, world, has_cuda=True)  # what every rank checks before building anything
    p = cfg.parallel
    dims = parallel_dims(cfg, world)
    axes = {"TP": dims.tp_size, "CP": dims.cp_size, "PP": dims.pp_size, "DP": dims.dp_size}
    for axis, size in re.findall(r"(TP|CP|PP|DP) (\d+)", layout["name"]):
        assert axes[axis] == int(size), (layout["name"], axes)
    assert ("SP" in layout["name"]) == p.sequence_parallel
    plan = memory_plan(
        cfg.model, tp=p.tensor_parallel_size, pp=p.pipeline_parallel_size, cp=p.context_parallel_size,
        sequence_parallel=p.sequence_parallel, zero=p.zero_stage, world=world,
        micro_batch=cfg.train.micro_batch_size, seq_len=cfg.data.seq_len, precision=cfg.train.precision,
    )
    total = plan.total_checkpointed if cfg.model.activation_checkpointing else plan.total
    assert f"{total / GIB:.1f}" == layout["gib"], (layout["name"], total / GIB)
    assert total < 80 * GIB  # an 80 GB GPU


def test_readme_names_every_layout() -> None:
    readme = (REPO / "README.md").read_text().replace("[", "").replace("]", "")  # [optional] SP
    for layout in LAYOUTS:
        overrides = " ".join(a for a in layout["args"].split() if not a.endswith(".yaml"))
        assert overrides in readme, layout["name"]
