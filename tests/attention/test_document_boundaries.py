"""Document boundaries (``data.document_boundaries: reset``): a packed batch of documents gives the
outputs and gradients of running each document on its own, in every attention form; without
boundaries nothing changes."""

from __future__ import annotations

import pytest
import torch

from megaflex.attention import AttentionCore, LinearAttentionState, causal_linear_attention
from megaflex.attention.documents import document_positions
from megaflex.attention.hybrid import LocalMixingCore
from attention_helpers import form_steps
from numerics import assert_close, normwise_scale

HEADS, HEAD_DIM = 2, 8
# two rows of 32 tokens: three documents, then two (another cut, so rows restart at different places)
ROWS = ((7, 13, 12), (20, 12))


def starts_of(rows: tuple[tuple[int, ...], ...] = ROWS) -> torch.Tensor:
    """[B, N] bool document starts of rows of documents with these lengths."""
    n = sum(rows[0])
    starts = torch.zeros(len(rows), n, dtype=torch.bool)
    for b, lengths in enumerate(rows):
        assert sum(lengths) == n
        for lo in torch.tensor(lengths).cumsum(0)[:-1].tolist():
            starts[b, lo] = True
    return starts


def spans(rows: tuple[tuple[int, ...], ...] = ROWS) -> list[tuple[int, int, int]]:
    """(row, first token, end) of every document."""
    out = []
    for b, lengths in enumerate(rows):
        lo = 0
        for length in lengths:
            out.append((b, lo, lo + length))
            lo += length
    return out


def random_inputs(n: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(len(ROWS), HEADS, n, HEAD_DIM, generator=gen) for _ in range(4)]  # q, k, v, output weights


def packed_vs_separate(attend, params: list[torch.nn.Parameter], steps: float, initial_state=None, name: str = "") -> None:
    """``attend(q, k, v, starts, state)`` on the packed rows vs on each document alone (the first
    document of a row continuing ``initial_state``'s row): outputs, input and parameter gradients."""
    n = sum(ROWS[0])
    q, k, v, weight = random_inputs(n)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attend(*leaves, starts_of(), initial_state)
    (out * weight).sum().backward()
    packed = [t.grad for t in leaves] + [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    total, outs, grads = 0.0, [], []
    for b, lo, hi in spans():
        part = [t[b : b + 1, :, lo:hi].clone().requires_grad_() for t in (q, k, v)]
        state = None
        if initial_state is not None and lo == 0:
            state = LinearAttentionState(*(getattr(initial_state, f)[b : b + 1] for f in ("kv", "k_sum", "log_max")))
        alone = attend(*part, None, state)
        total = total + (alone * weight[b : b + 1, :, lo:hi]).sum()
        outs.append((b, lo, hi, alone))
        grads.append((b, lo, hi, part))
    total.backward()
    terms = max(normwise_scale(g) for g in packed)
    for b, lo, hi, alone in outs:
        assert_close(out[b : b + 1, :, lo:hi], alone, steps=steps, name=f"{name} out {b} {lo}:{hi}")
    for b, lo, hi, part in grads:
        for label, g, t in zip("qkv", packed, part):
            assert_close(g[b : b + 1, :, lo:hi], t.grad, steps=steps, floor=terms, name=f"{name} d{label} {b} {lo}:{hi}")
    for p, g in zip(params, packed[3:]):
        assert_close(p.grad, g, steps=steps, floor=terms, name=f"{name} parameter gradient")


def some_state(features: int, seed: int = 5) -> LinearAttentionState:
    gen = torch.Generator().manual_seed(seed)
    batch = len(ROWS)
    return LinearAttentionState(
        torch.randn(batch, HEADS, features, HEAD_DIM, generator=gen), torch.randn(batch, HEADS, features, generator=gen),
        torch.randn(batch, HEADS, generator=gen), offset=3,
    )


@pytest.mark.parametrize("form", ["quadratic", "recurrent", "chunked"])
@pytest.mark.parametrize("carried", [False, True])
def test_linear_forms_restart_at_each_document(form: str, carried: bool) -> None:
    from megaflex.attention import build_feature_map

    fmap = build_feature_map("flexformer_n", HEADS, HEAD_DIM, 16)
    state = some_state(fmap.feature_dim) if carried else None

    def attend(q, k, v, starts, initial):
        fq, fk = fmap(q, 0), fmap(k, 0)
        out, _ = causal_linear_attention(
            fq.features, fk.features, fk.log_scale, v, form=form, chunk_size=8, initial_state=initial, document_starts=starts
        )
        return out

    q, k, v, _ = random_inputs(sum(ROWS[0]))
    packed_vs_separate(attend, list(fmap.parameters()), form_steps(fmap, q, k, v, extra_tokens=1), state, name=form)


def test_final_state_is_the_last_documents() -> None:
    from megaflex.attention import build_feature_map

    fmap = build_feature_map("elu", HEADS, HEAD_DIM, 16)
    q, k, v, _ = random_inputs(32)
    fq, fk = fmap(q, 0), fmap(k, 0)
    state = some_state(fmap.feature_dim)
    for form in ("quadratic", "recurrent", "chunked"):
        _, packed = causal_linear_attention(fq.features, fk.features, None, v, form=form, chunk_size=8,
                                            initial_state=state, document_starts=starts_of())  # fmt: skip
        for b, lengths in enumerate(ROWS):
            lo = 32 - lengths[-1]
            _, alone = causal_linear_attention(fq.features[b : b + 1, :, lo:], fk.features[b : b + 1, :, lo:], None,
                                               v[b : b + 1, :, lo:], form=form, chunk_size=8)  # fmt: skip
            steps = form_steps(fmap, q, k, v)
            assert_close(packed.kv[b : b + 1], alone.kv, steps=steps, name=f"{form} kv")
            assert_close(packed.k_sum[b : b + 1], alone.k_sum, steps=steps, name=f"{form} k_sum")
        assert packed.offset == state.offset + 32


def core_attend(core):
    def attend(q, k, v, starts, initial):
        return core(q, k, v, state=initial, document_starts=starts)[0]

    return attend


@pytest.mark.parametrize("kind", ["flexformer_n", "hedgehog"])
@pytest.mark.parametrize("form", ["quadratic", "recurrent", "chunked"])
@pytest.mark.parametrize("carried", [False, True])
def test_attention_core_restarts_in_every_form(kind: str, form: str, carried: bool) -> None:
    torch.manual_seed(0)
    core = AttentionCore(kind, HEADS, HEAD_DIM, feature_dim=16, chunk_size=8, form=form, backend="torch")
    q, k, v, _ = random_inputs(32)
    state = some_state(core.feature_map.feature_dim) if carried else None
    steps = form_steps(core.feature_map, q, k, v, extra_tokens=1)
    packed_vs_separate(core_attend(core), list(core.parameters()), steps, state, name=f"{kind} {form}")
    # with return_state each document runs on its own (the batched path keeps no state): same outputs
    batched, _ = core(q, k, v, state=state, document_starts=starts_of())
    one_by_one, final = core(q, k, v, state=state, document_starts=starts_of(), return_state=True)
    assert_close(batched, one_by_one, steps=steps, name="batched vs one by one")
    assert final.offset == (0 if state is None else state.offset) + 32


def test_softmax_is_block_causal() -> None:
    core = AttentionCore("softmax", HEADS, HEAD_DIM)
    packed_vs_separate(core_attend(core), [], steps=2 * (32 + HEAD_DIM + 8), name="softmax")


@pytest.mark.parametrize("window,conv_size", [(5, 0), (0, 3), (5, 3)])
def test_hybrid_window_and_convolution_stay_in_their_document(window: int, conv_size: int) -> None:
    torch.manual_seed(0)
    core = AttentionCore("flexformer_n", HEADS, HEAD_DIM, feature_dim=16, chunk_size=8, backend="torch")
    hybrid = LocalMixingCore(core, window=window, conv_size=conv_size)
    with torch.no_grad():  # leave the identity init, so the taps reach the previous tokens
        if hybrid.conv_weight is not None:
            hybrid.conv_weight.add_(0.3 * torch.randn_like(hybrid.conv_weight))
        if hybrid.window_mix is not None:
            hybrid.window_mix.fill_(0.4)
    q, k, v, _ = random_inputs(32)
    steps = form_steps(core.feature_map, q, k, v) + 2 * (window + conv_size + HEAD_DIM)
    packed_vs_separate(core_attend(hybrid), list(hybrid.parameters()), steps, name=f"hybrid {window} {conv_size}")


def test_without_restarts_the_plain_path_runs_bit_identical() -> None:
    torch.manual_seed(0)
    core = AttentionCore("flexformer_n", HEADS, HEAD_DIM, feature_dim=16, chunk_size=8)
    q, k, v, _ = random_inputs(32)
    starts = torch.zeros(len(ROWS), 32, dtype=torch.bool)
    starts[:, 0] = True  # a start at position 0 changes nothing without a carried state
    assert torch.equal(core(q, k, v, document_starts=starts)[0], core(q, k, v)[0])


def test_document_positions_count_from_each_start() -> None:
    eod = 2
    ids = torch.tensor([[5, 6, 2, 7, 2, 2, 8, 9], [2, 4, 4, 4, 4, 4, 4, 2]])
    want = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]])
    assert torch.equal(document_positions(ids, eod), want)
    assert torch.equal(document_positions(ids, eod) == 0, want == 0)


def test_document_starts_are_checked() -> None:
    core = AttentionCore("elu", HEADS, HEAD_DIM, feature_dim=16)
    q = torch.randn(2, HEADS, 8, HEAD_DIM)
    with pytest.raises(ValueError, match=r"document_starts: expected a bool tensor of shape \(2, 8\)"):
        core(q, q, q, document_starts=torch.zeros(2, 8, dtype=torch.long))


# ----------------------------------------------------------------------------------------
# the model and the trainer's batches
# ----------------------------------------------------------------------------------------
EOD = 2


def packed_documents(lengths: tuple[int, ...] = ROWS[0], seed: int = 3) -> list[torch.Tensor]:
    """Documents of random ids in [3, 64), each ending with EOD."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, 64, (length,), generator=gen) for length in lengths]
    for doc in docs:
        doc[-1] = EOD
    return docs


@pytest.mark.parametrize("kind,window", [("flexformer_n", 0), ("softmax", 0), ("flexformer_n", 4)])
def test_model_loss_on_a_packed_batch_is_the_sum_over_its_documents(kind: str, window: int) -> None:
    from megaflex.model import GPT, ModelConfig
    from megaflex.model.gpt import Documents
    from numerics import gpt_steps

    config = ModelConfig(vocab_size=64, num_layers=2, hidden_size=32, num_heads=2, feature_dim=16, chunk_size=8,
                         max_seq_len=64, attention=kind, softmax_window=window)  # fmt: skip
    torch.manual_seed(0)
    model = GPT(config)
    docs = packed_documents()
    ids = torch.cat(docs).unsqueeze(0)  # [1, 32]
    labels = torch.randint(0, 64, ids.shape, generator=torch.Generator().manual_seed(4))
    positions = document_positions(ids, EOD)
    packed = model(ids, labels=labels, documents=Documents(positions == 0, positions))
    packed.loss.backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    total, lo = 0.0, 0
    for doc in docs:
        hi = lo + len(doc)
        alone = model(doc.unsqueeze(0), labels=labels[:, lo:hi])
        steps = gpt_steps(config, 32) + 32 + config.vocab_size
        assert_close(packed.per_token_loss[:, lo:hi], alone.per_token_loss, steps=steps, name=f"loss {lo}:{hi}")
        total = total + alone.per_token_loss.sum()
        lo = hi
    (total / ids.numel()).backward()
    assert_close(packed.loss, total.detach() / ids.numel(), steps=gpt_steps(config, 32) + 2 * 32 + config.vocab_size, name="loss")
    terms = max(normwise_scale(g) for g in want.values())
    grad_steps = gpt_steps(config, 32, backward=True) + 2 * (32 + config.vocab_size)
    for name, p in model.named_parameters():
        assert_close(p.grad, want[name], steps=grad_steps, floor=terms, name=name)


def test_model_without_restarts_is_bit_identical() -> None:
    from megaflex.model import GPT, ModelConfig
    from megaflex.model.gpt import Documents

    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=64, num_layers=1, hidden_size=32, num_heads=2, feature_dim=16, chunk_size=8))
    ids = torch.randint(3, 64, (2, 24), generator=torch.Generator().manual_seed(1))  # no EOD: one document per row
    starts = document_positions(ids, EOD) == 0
    assert torch.equal(model(ids, documents=Documents(starts)).logits, model(ids).logits)


@pytest.mark.parametrize("window,mixing", [(0, "shared_normaliser"), (4, "shared_normaliser"), (4, "gated")])
def test_model_lays_out_the_documents_once_per_forward(monkeypatch, window: int, mixing: str) -> None:
    """The starts are cut into documents (and the batched plan built) once per forward, not per
    layer nor again in the activation-checkpointing recompute."""
    from megaflex.attention import documents
    from megaflex.model import GPT, ModelConfig
    from megaflex.model.gpt import Documents

    calls = {"spans": 0, "plan": 0}

    def counted(name, fn):
        def wrapper(*args):
            calls[name] += 1
            return fn(*args)
        return wrapper

    monkeypatch.setattr(documents, "_document_spans", counted("spans", documents._document_spans))
    monkeypatch.setattr(documents._BatchedPlan, "of", counted("plan", documents._BatchedPlan.of))
    config = ModelConfig(vocab_size=64, num_layers=2, hidden_size=32, num_heads=2, feature_dim=16, chunk_size=8,
                         max_seq_len=64, softmax_window=window, window_mixing=mixing, activation_checkpointing=True)
    torch.manual_seed(0)
    model = GPT(config).train()
    ids = torch.cat(packed_documents()).unsqueeze(0)
    positions = document_positions(ids, EOD)
    model(ids, labels=ids, documents=Documents(positions == 0, positions)).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert calls == {"spans": 1, "plan": 1}


def test_micro_batches_carry_document_positions_of_the_whole_sequence() -> None:
    from megaflex.training.batches import BatchLayout, batch_stream

    def first(dataset, **layout):  # the first micro-batch of 2 samples
        with batch_stream(dataset, BatchLayout(2, **layout), "cpu", count=1) as batches:
            return next(batches)

    tokens = torch.cat(packed_documents((5, 9, 7, 12))).numpy()  # 33 tokens: one sample of 32 + 1
    dataset = [tokens, tokens[::-1].copy()]
    whole = first(dataset, eod_id=EOD, reset_positions=True)
    positions = whole.documents.position_ids
    assert torch.equal(positions, document_positions(whole.input_ids, EOD))
    halves = [first(dataset, cp_rank=r, cp_size=2, eod_id=EOD, reset_positions=True) for r in range(2)]
    assert torch.equal(torch.cat([h.documents.position_ids for h in halves], dim=1), positions)  # rank 1 counts from the documents' starts
    assert halves[1].documents.position_ids[0, 0] > 0  # its slice begins mid-document
    documents = first(dataset, eod_id=EOD).documents
    assert torch.equal(documents.starts, positions == 0) and documents.position_ids is None
    assert first(dataset, reset_positions=True).documents is None
    assert first(dataset).documents is None  # no document boundaries: (ids, labels) as before


def test_config_needs_an_eod_id_for_resets() -> None:
    from pathlib import Path

    from megaflex.training.config import ConfigError, load_config

    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
    with pytest.raises(ConfigError, match="data.document_boundaries.*needs the EOD id"):
        load_config([tiny], ["data.source=synthetic", "data.tokenizer=null", "data.document_boundaries=reset"])
    with pytest.raises(ConfigError, match="data.reset_positions.*needs data.document_boundaries=reset"):
        load_config([tiny], ["data.source=synthetic", "data.reset_positions=true"])
    cfg = load_config([tiny], ["data.source=synthetic", "data.document_boundaries=reset", "data.eod_token_id=2"])
    from megaflex.training.data import document_eod_id

    assert document_eod_id(cfg) == 2
