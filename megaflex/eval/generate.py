"""Text generation with the recurrent O(1)-per-token state (console script ``megaflex-generate``).

The prompt is run once through the parallel (chunked) forward, which returns every layer's
state (recurrent ``LinearAttentionState`` for linear kinds, a KV cache for softmax); then each
new token is a length-1 forward that consumes and returns that state. For Flexformer the cost
per token is constant in the context length.

    megaflex-generate --checkpoint runs/tiny --prompt "The history of" --max-new-tokens 100 \\
        --temperature 0.8 --top-k 50 --top-p 0.95 --seed 0
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from megaflex.cli_args import available_device, nonnegative_float, positive_int, unit_interval


@dataclass
class SamplingConfig:
    """How the next token is chosen from the logits. ``temperature == 0`` means greedy."""

    temperature: float = 1.0
    top_k: int | None = None  # keep the k most likely tokens (None = all)
    top_p: float | None = None  # keep the smallest set with cumulative probability >= p (nucleus)

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature: expected >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k: expected a positive int or None, got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected 0 < top_p <= 1 or None, got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def mask_beyond_vocab(logits: torch.Tensor, vocab_limit: int | None) -> torch.Tensor:
    """``logits`` [..., V] with every id >= ``vocab_limit`` (the tokenizer's vocabulary, when the
    model's is padded beyond it) set to -inf, so no sampler can pick an id the tokenizer lacks."""
    if vocab_limit is None or vocab_limit >= logits.shape[-1]:
        return logits
    if vocab_limit < 1:
        raise ValueError(f"vocab_limit: expected a positive int, got {vocab_limit!r}")
    logits = logits.clone()
    logits[..., vocab_limit:] = float("-inf")
    return logits


def sample_next(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids [B] from fp32 ``logits`` [B, V] (greedy, temperature, top-k, top-p)."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens strictly more likely already reach top_p (the top one stays)
        drop_sorted = probs.cumsum(dim=-1) - probs >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_tokens(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    *,
    generator: torch.Generator | None = None,
    stop_ids: Sequence[int] = (),
    vocab_limit: int | None = None,
) -> Iterator[torch.Tensor]:
    """Yield next-token ids [B] one at a time, continuing ``prompt`` [B, N] with carried state.

    Logits go through ``model.gather_logits`` (full vocabulary, padding removed, gathered over
    tensor-parallel ranks) when the model has it; ids >= ``vocab_limit`` (the tokenizer's
    vocabulary size) are never produced. Stops after ``max_new_tokens`` or once every row has
    produced one of ``stop_ids``.
    """
    sampling = sampling or SamplingConfig()
    if prompt.dim() != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt: expected token ids of shape [B, N] with N >= 1, got {tuple(prompt.shape)}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens!r}")
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        gather = getattr(model, "gather_logits", lambda logits: logits)
        out = model(prompt.to(device), state=None, return_state=True)  # prefill: parallel form
        state = out.state
        logits = gather(out.logits[:, -1])  # [B, V]
        done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=device)
        stop = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
        for _ in range(max_new_tokens):
            token = sample_next(mask_beyond_vocab(logits.float(), vocab_limit), sampling, generator)  # [B]
            yield token
            done |= torch.isin(token, stop)
            if bool(done.all()):
                return
            out = model(token[:, None], state=state, return_state=True)  # O(1) recurrent step
            state = out.state
            logits = gather(out.logits[:, -1])
    finally:
        model.train(was_training)


def generate(model: torch.nn.Module, prompt: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig | None = None,
             **kwargs: Any) -> torch.Tensor:
    """All generated ids [B, M] (M <= max_new_tokens) of ``generate_tokens``."""
    tokens = list(generate_tokens(model, prompt, max_new_tokens, sampling, **kwargs))
    if not tokens:
        return torch.zeros(prompt.shape[0], 0, dtype=torch.long)
    return torch.stack(tokens, dim=1).cpu()


class TextStreamer:
    """Turns a growing list of ids into newly printable text (re-decodes the tail so multi-token
    characters and sentencepiece word-boundary spaces come out right)."""

    def __init__(self, decode: Any, prompt_ids: Sequence[int] = ()) -> None:
        self.decode = decode
        self.ids = list(prompt_ids)  # decoding with the prompt keeps the first word's leading space
        self.printed = len(decode(self.ids)) if self.ids else 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._unprinted(wait_for_character=True)

    def flush(self) -> str:
        """What is still unprinted at the end: the tail of a byte sequence that never became a
        character (shown as the decoder's replacement characters rather than dropped)."""
        return self._unprinted(wait_for_character=False)

    def _unprinted(self, wait_for_character: bool) -> str:
        text = self.decode(self.ids)
        if wait_for_character and text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more
            return ""
        new, self.printed = text[self.printed :], len(text)
        return new


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megaflex-generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory written by megaflex-train")
    parser.add_argument("--prompt", required=True, help="prompt text ('-' reads stdin)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=100)
    parser.add_argument("--temperature", type=nonnegative_float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=positive_int, default=None)
    parser.add_argument("--top-p", type=unit_interval, default=None, help="nucleus sampling, 0 < p <= 1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None, help="tokenizer model (default: the one in the checkpoint config)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    parser.add_argument("--device", type=available_device, default="cpu")
    parser.add_argument("--stop-at-eos", action="store_true", help="stop at the tokenizer's end-of-document id")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``megaflex-generate``: exit status 0 after streaming the continuation of
    ``--prompt`` to stdout, 2 on bad input (message on stderr)."""
    args = build_parser().parse_args(argv)
    from megaflex.eval.loading import USER_ERRORS

    try:
        _generate_cli(args)
    except USER_ERRORS as e:  # DataError / TokenizerMismatchError / CheckpointError included
        print(f"megaflex-generate: error: {e}", file=sys.stderr)
        return 2
    return 0


def _generate_cli(args: argparse.Namespace) -> None:
    from megaflex.eval.eval_data import check_eval_tokenizer
    from megaflex.eval.loading import load_for_eval, refuse_bidirectional  # late import: keeps the library part light

    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    refuse_bidirectional(args.checkpoint, args.tag, "generation")
    loaded = load_for_eval(args.checkpoint, tag=args.tag, tokenizer=args.tokenizer, device=args.device)
    if loaded.tokenizer is None:
        raise ValueError("--tokenizer: the checkpoint config names no tokenizer; pass --tokenizer PATH")
    check_eval_tokenizer(loaded.meta.tokenizer, loaded.tokenizer, None, str(loaded.path))
    prompt_text = sys.stdin.read() if args.prompt == "-" else args.prompt
    prompt = torch.tensor([loaded.tokenizer.encode(prompt_text)], dtype=torch.long)
    if prompt.shape[1] == 0:
        raise ValueError("--prompt: expected at least one token, got an empty prompt")
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    stop_ids = [loaded.eod_id] if args.stop_at_eos and loaded.eod_id is not None else []
    streamer = TextStreamer(loaded.tokenizer.decode, prompt[0].tolist())
    sys.stdout.write(prompt_text)
    for token in generate_tokens(loaded.model, prompt, args.max_new_tokens, sampling, generator=generator,
                                 stop_ids=stop_ids, vocab_limit=loaded.tokenizer.vocab_size):
        sys.stdout.write(streamer.push(int(token[0])))
        sys.stdout.flush()
    sys.stdout.write(streamer.flush() + "\n")


if __name__ == "__main__":
    sys.exit(main())
