"""``FlexformerForCausalLM``: a megaflex ``GPT`` behind the ``transformers`` causal-LM interface.

The module holds the megaflex model itself (``self.model`` is a ``megaflex.model.GPT`` on one
device), so parameter names are megaflex's with a ``model.`` prefix and the maths is the code
megaflex trains with. The decoding cache is ``FlexformerCache``, a ``transformers`` ``Cache``
wrapping megaflex's ``GPTState``: per layer a fixed-size recurrent ``LinearAttentionState``
(O(1) memory per token) for the linear kinds, a ``KVCache`` for softmax. Each forward that is
given a cache continues from it (the recurrent form for a few new tokens) and stores the new
state in it, which is how ``generate()`` and manual ``cache`` reuse work.

Padding: ``attention_mask`` (left or right padding, as ``generate()`` and lm-evaluation-harness
pass it: every token so far, cached ones first) goes to ``GPT.forward``: padded tokens add
nothing to the linear state, the softmax window or the KV cache, and positions (RoPE) count
from each row's first real token, so each row of a padded batch computes what it computes alone.
``generate()`` on right-padded prompts feeds each row with its pads moved first
(``prepare_inputs_for_generation``), so it continues from the last real token.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import Cache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from megaflex.attention import KVCache, LinearAttentionState
from megaflex.attention.hybrid import HybridState
from megaflex.attention.window import WindowCache
from megaflex.hf.configuration import FlexformerConfig
from megaflex.model.gpt import GPT, IGNORE_INDEX, GPTState


class FlexformerCache(Cache):
    """megaflex's decoding state as a ``transformers`` cache (``state`` is None before any token)."""

    is_compileable = False

    def __init__(self, state: GPTState | None = None) -> None:
        super().__init__(layers=[])
        self.state = state
        # generate() filled it with each row's pads moved first (prepare_inputs_for_generation):
        # every later mask is rearranged the same way, to match the cached keys
        self.pads_first = False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.state is None else self.state.offset

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1  # unbounded: the linear kinds' state has a fixed size, the KV cache grows

    @property
    def is_croppable(self) -> bool:
        return False  # a recurrent state cannot forget its last tokens

    def __len__(self) -> int:
        return 0 if self.state is None else len(self.state.layers)

    def reset(self) -> None:
        self.state, self.pads_first = None, False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("FlexformerCache: a recurrent state cannot be cropped (no assisted decoding)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def _map_batch(self, fn: Any) -> None:
        """Apply ``fn`` to the batch dim of every tensor of the state (beam search, num_return_sequences)."""
        if self.state is None:
            return
        self.state = GPTState(layers=[_map_layer_state(s, fn) for s in self.state.layers], offset=self.state.offset)


def _map_layer_state(s: Any, fn: Any) -> Any:
    """One layer's state with ``fn`` applied to each of its batch-first tensors."""
    if s is None:
        return None
    if isinstance(s, KVCache):
        return KVCache(fn(s.k), fn(s.v))
    if isinstance(s, LinearAttentionState):
        return LinearAttentionState(fn(s.kv), fn(s.k_sum), fn(s.log_max), s.offset)
    if isinstance(s, WindowCache):
        return WindowCache(fn(s.k), fn(s.kf), fn(s.kls), fn(s.v))
    if isinstance(s, HybridState):
        maybe = (lambda t: None if t is None else fn(t))  # noqa: E731
        return HybridState(_map_layer_state(s.linear, fn), maybe(s.window_k), maybe(s.window_v), maybe(s.conv_tail),
                           _map_layer_state(s.window_cache, fn))  # fmt: skip
    raise TypeError(f"cache: unexpected layer state {type(s).__name__}")


class FlexformerForCausalLM(PreTrainedModel, GenerationMixin):
    """Causal LM over a single-device megaflex ``GPT`` (logits [B, N, vocab_size], padding removed)."""

    config_class = FlexformerConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"

    def __init__(self, config: FlexformerConfig) -> None:
        super().__init__(config)
        # Built for real even when transformers asks for meta-device init (from_pretrained):
        # megaflex computes non-persistent buffers (RoPE frequencies, Performer draws) at
        # construction, and those are not in the weights file.
        with torch.device("cpu"):
            self.model = GPT(config.to_model_config())
        # transformers replaces non-persistent buffers with uninitialised memory when loading
        # (it expects _init_weights to recompute them); keep the constructed values to restore.
        self._constructed_buffers = {
            name: buf.detach().clone() for name, buf in self.named_buffers() if _is_non_persistent(self, name)
        }
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        """``PreTrainedModel.from_pretrained``, then the non-persistent buffers as megaflex built them."""
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # output_loading_info=True
        model.restore_constructed_buffers()
        return loaded

    def restore_constructed_buffers(self) -> None:
        """Put back the RoPE frequencies / fixed random features computed at construction."""
        for name, value in self._constructed_buffers.items():
            module_name, _, leaf = name.rpartition(".")
            module = self.get_submodule(module_name)
            current = module._buffers[leaf]
            module._buffers[leaf] = value.to(device=current.device, dtype=current.dtype)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # forward creates its own FlexformerCache

    def _init_weights(self, module: torch.nn.Module) -> None:
        pass  # GPT initialises itself in its constructor; loaded weights replace that

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: FlexformerCache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int = 0,
        past_key_values: FlexformerCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """``labels`` are the input ids (shifted inside, -100 ignored), as in every HF causal LM."""
        if input_ids is None or inputs_embeds is not None:
            raise ValueError("FlexformerForCausalLM: expected input_ids (inputs_embeds is not supported)")
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, FlexformerCache):
            raise ValueError(f"cache: expected a FlexformerCache (or None), got {type(cache).__name__}")
        if use_cache is None:  # a bidirectional model has no decoding state: plain model(ids) returns none
            use_cache = self.config.use_cache and self.config.causal
        elif use_cache and not self.config.causal:
            raise ValueError("use_cache: this model is bidirectional (config.causal=False): it has no decoding state, "
                             "so it cannot continue a sequence or generate(); call it with use_cache=False")
        state = None if cache is None else cache.state
        out = self.model(input_ids, state=state, return_state=bool(use_cache), attention_mask=attention_mask)
        hidden_logits = out.logits if not logits_to_keep else out.logits[:, -logits_to_keep:]
        logits = self.model.gather_logits(hidden_logits)  # [B, N, vocab_size]
        limit = self.config.tokenizer_vocab_size
        if limit is not None and limit < logits.shape[-1]:  # ids the tokenizer lacks are never predicted
            logits = logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) >= limit, float("-inf"))
        loss = None
        if labels is not None:
            targets = labels[:, 1:].to(logits.device)
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX
            )
        if use_cache:
            cache = cache if cache is not None else FlexformerCache()
            cache.state = out.state
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)

    def prepare_inputs_for_generation(
        self, input_ids: torch.LongTensor, next_sequence_length: int | None = None,
        cache: FlexformerCache | None = None, attention_mask: torch.Tensor | None = None, **kwargs: Any,
    ) -> dict[str, Any]:
        """Feed only the tokens the cache has not consumed yet (also for a reused, pre-filled cache).

        Right-padded prompts: ``generate()`` appends each new token after the pads and reads the
        next-token logits at the last position, a pad. Every row is therefore fed with its pads
        moved in front of its real tokens (a stable sort of the mask; order kept), i.e. as the
        left-padded batch it is equivalent to: pads add nothing and positions count real tokens
        only, so each row continues from its last real token, as it does alone. The new tokens
        (mask 1, at the end) stay last, so the slice of unseen tokens is unchanged. A cache the
        caller pre-filled is continued as it was filled."""
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        seen = 0 if cache is None else cache.get_seq_length()
        if seen == 0 and attention_mask is not None and not bool(attention_mask.all()):
            cache = cache if cache is not None else FlexformerCache()
            cache.pads_first = True  # not for a cache pre-filled by the caller: its keys keep their places
        if cache is not None and cache.pads_first and attention_mask is not None:
            order = torch.argsort(attention_mask.to(torch.int8), dim=1, stable=True)
            input_ids, attention_mask = input_ids.gather(1, order), attention_mask.gather(1, order)
        if seen >= input_ids.shape[1]:
            raise ValueError(
                f"cache: it already holds {seen} tokens but input_ids has {input_ids.shape[1]}; "
                "pass the cached tokens followed by at least one new token"
            )
        inputs: dict[str, Any] = {"input_ids": input_ids[:, seen:], "attention_mask": attention_mask,
                                  "use_cache": kwargs.get("use_cache", True)}
        if cache is not None:
            inputs["cache"] = cache
        return inputs


def _is_non_persistent(root: torch.nn.Module, name: str) -> bool:
    module_name, _, leaf = name.rpartition(".")
    return leaf in root.get_submodule(module_name)._non_persistent_buffers_set
