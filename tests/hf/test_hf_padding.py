"""Padded batches in ``FlexformerForCausalLM``: a left- or right-padded batch generates what each
prompt generates alone (greedy; beams and sampling as left-padded), right padding leaves the real positions' logits unchanged, every
attention form the model uses (quadratic / chunked prefill, recurrent decoding) ignores padded
keys, and an lm-evaluation-harness ``generate_until`` task runs at batch size 4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import megaflex.hf  # noqa: F401  (registers the Auto classes)
from megaflex.hf import FlexformerConfig, FlexformerForCausalLM
from megaflex.model.config import ModelConfig
from numerics import assert_close, gpt_steps

VOCAB = 203
PAD = 0
# a linear kind, the hybrid (softmax window; with the q/k/v convolution too) and exact softmax
KINDS = {
    "flexformer_n": {"attention": "flexformer_n"},
    "hybrid": {"attention": "flexformer_n", "softmax_window": 4},
    "hybrid_conv": {"attention": "flexformer_n", "softmax_window": 4, "qkv_conv_size": 3},
    "softmax": {"attention": "softmax"},
    "elu_learned_positions": {"attention": "elu", "position": "learned"},
}
REFUSING = {"cosformer": {"attention": "cosformer", "position": "learned"}}


def _model(kind: str, vocab: int = VOCAB, seed: int = 0) -> FlexformerForCausalLM:
    torch.manual_seed(seed)
    mc = ModelConfig(vocab_size=vocab, num_layers=2, hidden_size=48, num_heads=3, feature_dim=16, chunk_size=8,
                     max_seq_len=128, init_std=0.3, **{**KINDS, **REFUSING}[kind])  # large weights: outputs depend on every key
    return FlexformerForCausalLM(FlexformerConfig.from_model_config(mc, bos_token_id=2, eos_token_id=2)).eval()


def _prompts(lengths: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]


def _pad(prompts: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        where = slice(width - len(p), width) if side == "left" else slice(0, len(p))
        ids[i, where], mask[i, where] = p, 1
    return ids, mask


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_generates_what_each_prompt_generates_alone(kind: str, side: str) -> None:
    """Right padding (issue 37): generate() appends after the pads and reads the logits of the last
    position, so rows shorter than the batch continued from a pad before."""
    model = _model(kind)
    prompts = _prompts([3, 14, 9, 21], seed=1)  # pads span whole chunks (chunk_size 8) and windows
    ids, mask = _pad(prompts, side)
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None,
                           pad_token_id=PAD)
    for i, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=PAD)
        assert torch.equal(batch[i, ids.shape[1]:], alone[0, len(prompt):]), f"row {i} ({len(prompt)} tokens)"


@pytest.mark.parametrize("options", [{"num_beams": 3}, {"do_sample": True, "num_return_sequences": 2, "top_k": 5}],
                         ids=["beams", "sampling"])
def test_right_padded_generation_equals_left_padded(options: dict) -> None:
    """Beam search and sampling (the same draws) on right-padded prompts continue as on left-padded ones."""
    model = _model("hybrid_conv")
    prompts = _prompts([3, 14, 9], seed=8)
    outputs = {}
    for side in ("left", "right"):
        ids, mask = _pad(prompts, side)
        torch.manual_seed(0)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None, pad_token_id=PAD, **options)
        outputs[side] = out[:, ids.shape[1]:]
    assert torch.equal(outputs["left"], outputs["right"])


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_logits_at_real_positions_equal_unpadded(kind: str, side: str) -> None:
    model = _model(kind)
    prompts = _prompts([5, 19, 12], seed=2)
    ids, mask = _pad(prompts, side)
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, use_cache=False).logits
        for i, prompt in enumerate(prompts):
            alone = model(prompt[None], use_cache=False).logits[0]
            real = mask[i].bool()
            assert_close(padded[i, real], alone, steps=gpt_steps(model.model.config, ids.shape[1]))


def test_triton_prefill_ignores_padded_keys() -> None:
    """The chunked form in the Triton kernels (the prefill on CUDA; here the interpreter): padded
    keys go through the feature path, not the fused trig kernel, and change nothing."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'megaflex[dev]' installs it)")
    model = _model("flexformer_n")
    for block in model.model.blocks:
        block.attn.core.backend = "triton"
    prompts = _prompts([5, 19], seed=6)
    ids, mask = _pad(prompts, "left")
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, use_cache=False).logits
        for i, prompt in enumerate(prompts):
            alone = model(prompt[None], use_cache=False).logits[0]
            assert_close(padded[i, mask[i].bool()], alone, steps=gpt_steps(model.model.config, ids.shape[1]))


@pytest.mark.parametrize("form", ["quadratic", "chunked", "recurrent"])
def test_every_linear_form_ignores_padded_keys(form: str) -> None:
    """Prefill in each form, then continue from the cache with a few tokens (the decoding path)."""
    model = _model("hybrid_conv")
    for block in model.model.blocks:
        block.attn.core.core.form = form
    prompts = _prompts([4, 17], seed=3)
    ids, mask = _pad(prompts, "left")
    new = torch.randint(1, VOCAB, (2, 3), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        first = model(ids, attention_mask=mask, use_cache=True)
        full_mask = torch.cat([mask, torch.ones_like(new)], dim=1)
        step = model(new, attention_mask=full_mask, cache=first.cache).logits
        for i, prompt in enumerate(prompts):
            alone = model(torch.cat([prompt, new[i]])[None], use_cache=False).logits[0]
            assert_close(first.logits[i, mask[i].bool()], alone[: len(prompt)], steps=gpt_steps(model.model.config, 20))
            assert_close(step[i], alone[len(prompt):], steps=gpt_steps(model.model.config, 20))


def test_cosformer_refuses_padding() -> None:
    """Its feature map depends on absolute positions, which padding would shift row by row."""
    model = _model("cosformer")
    ids, mask = _pad(_prompts([3, 6], seed=7), "left")
    with pytest.raises(ValueError, match="padding is not supported by the position-dependent 'cosformer' map"):
        model(ids, attention_mask=mask)


def test_all_real_mask_is_the_unmasked_model() -> None:
    model = _model("flexformer_n")
    ids = torch.cat(_prompts([11, 11], seed=5)).view(2, 11)
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=torch.ones_like(ids)).logits, model(ids).logits)


def test_lm_eval_generate_until_at_batch_size_4(tmp_path: Path, shared_data: Path) -> None:
    """A local generate_until task over real WikiText prompts of different lengths: lm-eval's
    left-padded batches of 4 produce what each prompt generates alone."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from data_prep.train_tokenizer import TokenizerTrainConfig, train_tokenizer
    from megaflex.hf.tokenizer import save_tokenizer
    from transformers import AutoConfig

    raw = (shared_data / "wikitext-2-raw" / "wiki.valid.raw").read_text(encoding="utf-8")
    (tmp_path / "train.raw").write_text(raw[:60_000], encoding="utf-8")
    tok_path = train_tokenizer(TokenizerTrainConfig(inputs=[str(tmp_path / "train.raw")], vocab_size=300,
                                                    output_prefix=str(tmp_path / "tok"), tokenizer_type="bpe"))
    hf_dir = tmp_path / "hf"
    hf_tok = save_tokenizer(tok_path, hf_dir, model_max_length=128)
    model = _model("hybrid", vocab=300)
    model.config.update(dict(bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id,
                             pad_token_id=hf_tok.pad_token_id))
    model.save_pretrained(hf_dir)
    assert AutoConfig.from_pretrained(hf_dir).to_model_config().softmax_window == 4  # the hybrid survives export
    lines = [line.strip() for line in raw.splitlines() if len(line.split()) > 12][:6]
    docs = [{"question": " ".join(line.split()[: 3 + 4 * i]), "answer": "x"} for i, line in enumerate(lines)]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / "padded_gen.yaml").write_text(json.dumps({
        "task": "padded_gen", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(tasks / "docs.jsonl")}},
        "test_split": "test", "output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["<|never|>"], "max_gen_toks": 8, "do_sample": False},
        "metric_list": [{"metric": "exact_match"}], "metadata": {"version": 1.0},
    }))
    results = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={hf_dir},dtype=float32,max_length=128", tasks=["padded_gen"],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False), batch_size=4, device="cpu", log_samples=True,
    )
    samples = results["samples"]["padded_gen"]
    assert len(samples) == len(docs)
    for sample in samples:
        prompt = torch.tensor([hf_tok(sample["doc"]["question"])["input_ids"]])
        alone = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=PAD)
        assert sample["resps"][0][0] == hf_tok.decode(alone[0, prompt.shape[1]:], skip_special_tokens=True)
