"""Distributed perplexity: 1, 2 and 4 gloo ranks give the same result (to float rounding)."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from megaflex.eval.scoring import MODES, evaluate

DOC_LENGTHS = [1, 3, 9, 40, 41, 77, 2]
CONTEXT = 16


def _evaluate_all_modes(rank: int, world_size: int) -> dict[str, dict]:
    # Imported here so the spawned ranks build exactly the same tiny model as the parent.
    from test_eval_scoring import random_docs, tiny_gpt

    model = tiny_gpt("flexformer_n")
    docs = random_docs(DOC_LENGTHS)
    token_bytes = torch.arange(97) % 5
    out = {}
    for mode in MODES:
        result = evaluate(model, docs, mode, CONTEXT, batch_size=3, token_bytes=token_bytes,
                          rank=rank, world_size=world_size)
        out[mode] = {"nll": result.nll_sum, "tokens": result.tokens, "bytes": result.bytes,
                     "buckets": result.bucket_tokens, "ppl": result.ppl}
    return out


@pytest.mark.slow
def test_perplexity_is_identical_for_1_2_and_4_ranks() -> None:
    single = _evaluate_all_modes(0, 1)
    expected_tokens = sum(n - 1 for n in DOC_LENGTHS if n > 1)
    for world_size in (2, 4):
        per_rank = run_distributed(_evaluate_all_modes, world_size=world_size)
        for rank_result in per_rank:  # every rank ends with the same reduced numbers
            for mode in MODES:
                got, ref = rank_result[mode], single[mode]
                assert got["tokens"] == ref["tokens"] == expected_tokens, (world_size, mode)
                assert got["bytes"] == ref["bytes"], (world_size, mode)
                assert got["buckets"] == ref["buckets"], (world_size, mode)
                assert got["nll"] == pytest.approx(ref["nll"], rel=1e-6), (world_size, mode)
                assert got["ppl"] == pytest.approx(ref["ppl"], rel=1e-6), (world_size, mode)
