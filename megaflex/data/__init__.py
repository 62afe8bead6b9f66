"""megaflex.data: memory-mapped token datasets, GPT samples, blending, and DP sampling.

Typical use by training code::

    from megaflex.data import build_datasets, PretrainingSampler, Tokenizer

    tok = Tokenizer("tok/wt103.model")                  # encode/decode, eod_id, vocab_size, bytes per token
    sets = build_datasets(["data/wt103_train"], split="949,50,1", seq_len=1024,
                          num_samples_per_split=(train_iters * global_batch, eval_samples, None),
                          seed=1234, cache_dir="runs/x/index_cache",
                          is_builder=(rank == 0), barrier=dist.barrier)
    sampler = PretrainingSampler(len(sets["train"]), consumed_samples, micro_batch_size, dp_rank, dp_size)
    loader = torch.utils.data.DataLoader(sets["train"], batch_sampler=sampler, num_workers=2)
    # each batch: int64 [micro_batch_size, seq_len + 1]; inputs = b[:, :-1], targets = b[:, 1:]

Public API:

* :class:`IndexedDataset` (reader), :class:`IndexedDatasetBuilder` (writer), :func:`merge_datasets`,
  :class:`IndexedDatasetError` — Megatron-LM's ``.bin``/``.idx`` format, byte for byte.
* :class:`GPTDataset` — seq_len+1-token samples with cached document/sample/shuffle indices.
* :class:`BlendedDataset`, :func:`build_datasets` — weighted blends, train/valid/test splits.
* :class:`PretrainingSampler` — exact resume from ``consumed_samples``, DP-size independent order.
* :class:`Tokenizer` — sentencepiece model or ``tokenizers`` file + card written by ``data_prep.train_tokenizer``.
* :func:`read_data_card`, :func:`check_same_tokenizer` — the tokenizer identity recorded with the
  data (``PREFIX.card.json``) and with checkpoints; :class:`DataError` is the base of every data fault.
* ``megaflex.data.sources`` (imported on use) — documents streamed from raw text, JSONL or a
  Hugging Face dataset; ``data_prep`` and ``megaflex-eval`` read their inputs through it.
* ``megaflex.data.lra`` (imported on use) — Long Range Arena classification data: ListOps TSVs,
  byte-level IMDb Text and AAN Retrieval datasets, and their padding collate function.
"""

from megaflex.data.blended import BlendedDataset, blend_indices, build_datasets
from megaflex.data.gpt_dataset import GPTDataset, build_indices, parse_split, split_ranges
from megaflex.data.card import TokenizerMismatchError, check_same_tokenizer, data_tokenizer, read_data_card
from megaflex.data.indexed import (
    DataError,
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    merge_datasets,
    optimal_dtype,
)
from megaflex.data.sampler import PretrainingSampler
from megaflex.data.tokenizer import Tokenizer, TokenizerCard

__all__ = [
    "BlendedDataset",
    "DataError",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "PretrainingSampler",
    "Tokenizer",
    "TokenizerCard",
    "TokenizerMismatchError",
    "blend_indices",
    "build_datasets",
    "build_indices",
    "check_same_tokenizer",
    "data_tokenizer",
    "merge_datasets",
    "optimal_dtype",
    "parse_split",
    "read_data_card",
    "split_ranges",
]
