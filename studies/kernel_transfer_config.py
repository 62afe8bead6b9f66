"""The kernel-transfer experiment's configuration: kinds, arms, the B metric and
``TransferConfig`` (shared by the experiment and its report)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from studies.kernel_study_config import StudyConfig

KINDS = ("flexformer_n", "hedgehog")
ARMS = {
    "transfer": "kernel learned on A (english-docs), frozen; the rest trained from scratch on B",
    "learned_b": "kernel learned on B directly (ordinary training on B)",
    "random": "untrained kernel (the map's fresh init), frozen; the rest trained on B",
}
FROZEN = ["optimizer.freeze_kernel=true"]
B_METRIC = "wikitext2_test_ppl"


@dataclass
class TransferConfig:
    """The experiment: the kernel study's model/recipe (``study``) with A and B step counts."""

    study: StudyConfig
    kinds: tuple[str, ...] = KINDS
    steps_a: int = 300
    steps_b: int = 150
    data_work_dir: str = "work_data/kernel_study"  # tokenizer and A data, shared with the study
    jobs: int = 1  # (kind, seed) chains trained at once, each one process
    a_runs: str | None = None  # a kernel study's runs/ folder whose <kind>_s<seed> runs are domain A

    def config_a(self) -> StudyConfig:
        return replace(self.study, steps=self.steps_a)

    def config_b(self) -> StudyConfig:
        return replace(self.study, steps=self.steps_b)
