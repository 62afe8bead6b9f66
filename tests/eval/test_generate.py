"""Recurrent generation: greedy decoding matches the parallel forward; sampling filters."""

from __future__ import annotations

import pytest
import torch

from megaflex.eval.generate import SamplingConfig, TextStreamer, generate, sample_next
from test_eval_scoring import VOCAB, tiny_gpt


@pytest.mark.parametrize("attention", ["flexformer_n", "flexformer_s", "performer", "cosformer", "softmax"])
def test_greedy_recurrent_decoding_equals_argmax_of_full_forward(attention: str) -> None:
    # a large init makes the logits depend strongly on the context (varied greedy output)
    model = tiny_gpt(attention, seed=3, init_std=0.5)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (2, 11), generator=g)  # a batch of two prompts
    new = generate(model, prompt, 40, SamplingConfig(temperature=0))  # [2, 40]
    assert new.shape == (2, 40)
    with torch.no_grad():
        full = torch.cat([prompt, new[:, :-1]], dim=1)  # every generated token as input but the last
        logits = model.gather_logits(model(full).logits)  # [2, 11 + 39, VOCAB]
    predicted = logits[:, prompt.shape[1] - 1 :].argmax(dim=-1)  # prediction after each prefix
    assert torch.equal(predicted, new)
    assert len(set(new[0].tolist())) > 1  # not a degenerate constant sequence


def test_generation_stops_at_stop_ids_and_respects_max_new_tokens() -> None:
    model = tiny_gpt(seed=3)
    prompt = torch.tensor([[5, 6, 7]])
    greedy = generate(model, prompt, 12, SamplingConfig(temperature=0))
    stop = int(greedy[0, 4])
    first = greedy[0].tolist().index(stop)
    stopped = generate(model, prompt, 12, SamplingConfig(temperature=0), stop_ids=[stop])
    assert stopped[0].tolist() == greedy[0, : first + 1].tolist()
    assert generate(model, prompt, 0).shape == (1, 0)


def test_seeded_sampling_is_reproducible() -> None:
    model = tiny_gpt(seed=3)
    prompt = torch.tensor([[1, 2, 3]])
    cfg = SamplingConfig(temperature=1.0, top_k=20, top_p=0.9)
    a = generate(model, prompt, 15, cfg, generator=torch.Generator().manual_seed(7))
    b = generate(model, prompt, 15, cfg, generator=torch.Generator().manual_seed(7))
    c = generate(model, prompt, 15, cfg, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


# --- the sampling filters ---------------------------------------------------------------------

PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])


def _support(cfg: SamplingConfig, draws: int = 400) -> set[int]:
    g = torch.Generator().manual_seed(0)
    logits = PROBS.log().expand(draws, -1)
    return set(sample_next(logits, cfg, g).tolist())


def test_top_k_and_top_p_restrict_the_support() -> None:
    assert _support(SamplingConfig()) == {0, 1, 2, 3}
    assert _support(SamplingConfig(top_k=2)) == {0, 1}
    assert _support(SamplingConfig(top_k=1)) == {0}
    # nucleus: smallest set whose probability reaches p
    assert _support(SamplingConfig(top_p=0.5)) == {0}
    assert _support(SamplingConfig(top_p=0.8)) == {0, 1}
    assert _support(SamplingConfig(top_p=0.81)) == {0, 1, 2}
    assert _support(SamplingConfig(top_k=3, top_p=0.99)) == {0, 1, 2}


def test_temperature_sharpens_and_flattens_the_distribution() -> None:
    g = torch.Generator().manual_seed(0)
    logits = PROBS.log().expand(20000, -1)
    for temperature in (0.5, 1.0, 2.0):
        draws = sample_next(logits, SamplingConfig(temperature=temperature), g)
        freq = torch.bincount(draws, minlength=4).double() / len(draws)
        expected = torch.softmax(PROBS.log().double() / temperature, dim=-1)[0]
        assert torch.allclose(freq, expected, atol=0.015), (temperature, freq, expected)
    greedy = sample_next(torch.tensor([[0.1, 2.0, 1.9]]), SamplingConfig(temperature=0))
    assert greedy.tolist() == [1]


def test_sampling_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1)
    with pytest.raises(ValueError, match="top_k"):
        SamplingConfig(top_k=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=1.5)


def test_streamer_emits_text_only_at_complete_characters() -> None:
    text = "naïve café — 東京 ok"
    data = list(text.encode("utf-8"))  # one "token" per byte: multi-byte characters span tokens
    streamer = TextStreamer(lambda ids: bytes(ids).decode("utf-8", errors="replace"), prompt_ids=data[:3])
    pieces = [streamer.push(b) for b in data[3:]]
    assert "".join(pieces) == text[3:]
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # it did wait inside a multi-byte character


def test_streamer_flush_prints_a_trailing_incomplete_character() -> None:
    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731
    streamer = TextStreamer(decode, prompt_ids=list(b"ok"))
    cut = list("é東".encode("utf-8"))[:-1]  # "é" and the first two bytes of a three-byte character
    assert "".join(streamer.push(b) for b in cut) == "é"  # the tail waits for the character's last byte
    assert streamer.flush() == "\ufffd"  # the end of generation shows it instead of dropping it
    assert streamer.flush() == ""



def test_ids_beyond_the_tokenizer_vocabulary_are_never_sampled() -> None:
    # the model's vocabulary (97) may exceed the tokenizer's (padded configs): those ids decode to nothing
    model = tiny_gpt(seed=3, init_std=0.5)
    prompt = torch.tensor([[1, 2, 3]])
    limit = 40
    free = SamplingConfig(temperature=2.0)
    unmasked = generate(model, prompt, 60, free, generator=torch.Generator().manual_seed(0))
    assert int(unmasked.max()) >= limit  # without the mask these ids do come up
    for seed in range(3):
        masked = generate(model, prompt, 60, free, generator=torch.Generator().manual_seed(seed), vocab_limit=limit)
        assert int(masked.max()) < limit
    greedy = generate(model, prompt, 20, SamplingConfig(temperature=0), vocab_limit=limit)
    with torch.no_grad():
        full = torch.cat([prompt, greedy[:, :-1]], dim=1)
        logits = model.gather_logits(model(full).logits)[:, prompt.shape[1] - 1 :, :limit]
    assert torch.equal(logits.argmax(dim=-1), greedy)  # greedy = argmax over the tokenizer's ids only
