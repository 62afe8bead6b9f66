"""``megaflex-export``: a megaflex checkpoint as a Hugging Face model directory, and back.

    megaflex-export --checkpoint runs/tiny --hf-out hf/tiny [--dtype fp32|bf16] [--eval-json ppl.json]
    megaflex-export --from-hf hf/tiny --megaflex-out runs/tiny-from-hf

Export: ``load_for_eval`` merges the checkpoint's TP shards and ZeRO partitions (any stage, any
TP size) into one fp32 model, which is written as ``FlexformerForCausalLM``: config.json (with
``auto_map``), model.safetensors, generation_config.json, the tokenizer (``tokenizer.json`` +
the original megaflex tokenizer file: sentencepiece ``tokenizer.model`` or ``megaflex_tokenizer.json``), the ``trust_remote_code`` files (megaflex's
own source, bundled) and a README.md model card (training config, eval numbers from
``--eval-json`` files written by ``megaflex-eval --json``).

Import: the weights of an HF directory become a single-rank checkpoint folder
``<megaflex-out>/step_<iteration>`` (+ ``latest``) that ``megaflex-eval``/``megaflex-generate``
read; megaflex -> HF (fp32) -> megaflex gives bit-identical tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

import torch
import yaml

from megaflex.checkpoint import CheckpointMeta
from megaflex.cli_args import existing_file
from megaflex.output_dirs import (
    OutputDirError, apply_umask, check_output_dir, claim_output_dir, snapshot, training_run_owner,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def export_checkpoint(
    checkpoint: str | os.PathLike,
    hf_out: str | os.PathLike,
    *,
    dtype: str = "fp32",
    tag: str | None = None,
    tokenizer: str | None = None,
    eval_json: Sequence[str | os.PathLike] = (),
    overwrite: bool = False,
) -> Path:
    """Write the HF directory of ``checkpoint`` (folder, checkpoint.dir or run dir) to ``hf_out``
    (a new or empty directory unless ``overwrite``)."""
    from transformers import GenerationConfig

    from megaflex.eval.loading import load_for_eval
    from megaflex.data.tokenizer import Tokenizer
    from megaflex.hf import FlexformerConfig, FlexformerForCausalLM
    from megaflex.hf.remote_code import AUTO_MAP, write_remote_code
    from megaflex.hf.tokenizer import save_tokenizer

    if dtype not in DTYPES:
        raise ValueError(f"--dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    check_output_dir(hf_out, "--hf-out", overwrite)  # before the checkpoint is read
    loaded = load_for_eval(checkpoint, tag=tag, tokenizer=None)  # the tokenizer is checked below
    tok_path = tokenizer or (loaded.config.get("data") or {}).get("tokenizer")
    if not tok_path:
        raise ValueError("--tokenizer: the checkpoint config names no tokenizer (data.tokenizer); pass --tokenizer PATH")
    if not Path(tok_path).is_file():
        raise ValueError(f"--tokenizer: tokenizer model {tok_path!r} not found (from "
                         f"{'--tokenizer' if tokenizer else 'the checkpoint config data.tokenizer'}); pass --tokenizer PATH")
    out = claim_output_dir(hf_out, "--hf-out", overwrite)
    before = snapshot(out)
    model_config = loaded.model.config
    hf_tok = save_tokenizer(tok_path, out, model_max_length=model_config.max_seq_len)
    special = dict(bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id)
    config = FlexformerConfig.from_model_config(model_config, megaflex_run_config=loaded.config,
                                               megaflex_iteration=loaded.meta.iteration,
                                               tokenizer_vocab_size=Tokenizer(tok_path).vocab_size, **special)
    config.auto_map = dict(AUTO_MAP)
    model = FlexformerForCausalLM(config)
    model.model.load_state_dict(loaded.model.state_dict(), strict=True)
    model.to(DTYPES[dtype])
    model.generation_config = GenerationConfig(**special)
    model.save_pretrained(out)
    write_remote_code(out)
    evals = [json.loads(Path(p).read_text()) for p in eval_json]
    (out / "README.md").write_text(model_card(loaded.config, loaded.meta, loaded.path, dtype, evals), encoding="utf-8")
    apply_umask(out, before)
    return out


def import_hf(hf_dir: str | os.PathLike, megaflex_out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write the model of HF directory ``hf_dir`` as a megaflex checkpoint under ``megaflex_out``
    (a new or empty directory unless ``overwrite``; never a training run's checkpoint folder)."""
    from megaflex.hf import FlexformerConfig, FlexformerForCausalLM
    from megaflex.data.tokenizer import card_path
    from megaflex.hf.tokenizer import original_tokenizer_file
    from megaflex.checkpoint import layout, parameter_shapes

    src = Path(hf_dir)
    if not (src / "config.json").is_file():
        raise ValueError(f"--from-hf: expected a Hugging Face model directory with config.json, got {os.fspath(hf_dir)!r}")
    owner = training_run_owner(megaflex_out)
    if owner is not None:
        raise OutputDirError(f"--megaflex-out {os.fspath(megaflex_out)}: refusing to write into a training run's "
                             f"checkpoint folder ({owner}); only megaflex-train writes there: choose a new directory")
    config = FlexformerConfig.from_pretrained(src)  # ValueError naming a bad field of config.json
    check_weight_files(src)
    before = snapshot(claim_output_dir(megaflex_out, "--megaflex-out", overwrite))
    model = FlexformerForCausalLM.from_pretrained(src, config=config, dtype=torch.float32)
    run_config = dict(config.megaflex_run_config or {})
    run_config["model"] = config.to_model_config().to_dict()
    iteration = int(config.megaflex_iteration or 0)
    tag_dir = Path(megaflex_out) / layout.tag_for(iteration)
    tag_dir.mkdir(parents=True, exist_ok=True)
    data = dict(run_config.get("data") or {})
    original = original_tokenizer_file(src)
    if original is not None:  # the tokenizer travels with the checkpoint
        shutil.copyfile(original, tag_dir / original.name)
        if card_path(original).is_file():
            shutil.copyfile(card_path(original), card_path(tag_dir / original.name))
        data["tokenizer"] = str((tag_dir / original.name).resolve())
    run_config["data"] = data
    gpt = model.model
    # ZeRO-0 / TP-1 layout of a megaflex-train checkpoint: what megaflex.eval.loading reads.
    torch.save({"module": gpt.state_dict()}, layout.model_states_file(tag_dir, 0))
    meta = CheckpointMeta(
        iteration=iteration, tensor_parallel_size=1, world_size=1, data_parallel_size=1, zero_stage=0,
        parameter_shapes=parameter_shapes(gpt), num_parameters=gpt.num_parameters(), config=run_config,
        source=f"megaflex-export --from-hf {os.fspath(hf_dir)}",
    )
    layout.write_meta(tag_dir, meta.to_dict())  # with the checksums of every file written above
    layout.write_latest(megaflex_out, tag_dir.name)
    apply_umask(megaflex_out, before)
    return tag_dir


def check_weight_files(hf_dir: Path) -> None:
    """ValueError naming the first missing weight file of an HF directory (a single
    ``model.safetensors`` / ``pytorch_model.bin``, or every shard its index lists)."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = hf_dir / index_name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"--from-hf: {index} is not a valid weight index ({type(e).__name__}: {e})") from None
            missing = [name for name in shards if not (hf_dir / name).is_file()]
            if missing:
                raise ValueError(f"--from-hf: shard {hf_dir / missing[0]} listed in {index.name} is missing"
                                 + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
            return
    if not any((hf_dir / name).is_file() for name in ("model.safetensors", "pytorch_model.bin")):
        raise ValueError(f"--from-hf: {hf_dir} holds no weights (model.safetensors, pytorch_model.bin or a sharded index)")


def model_card(run_config: dict[str, Any], meta: CheckpointMeta, path: Path, dtype: str,
               evals: Sequence[dict[str, Any]]) -> str:
    """README.md of an export: what the model is, how it was trained, how to load and evaluate it."""
    m = run_config["model"]
    causal = m.get("causal", True)
    kind = "decoder-only LM" if causal else "bidirectional encoder (`model.causal: false`)"
    lines = [
        "---", "library_name: transformers", "tags: [megaflex, flexformer, linear-attention]", "---", "",
        f"# Flexformer ({m['attention']}) exported by megaflex", "",
        f"A {m['num_layers']}-layer, {m['hidden_size']}-wide {kind} with `{m['attention']}` attention, "
        f"trained with megaflex for {meta.iteration} iterations "
        f"(tensor parallel {meta.tensor_parallel_size}, ZeRO stage {'?' if meta.zero_stage is None else meta.zero_stage}); "
        f"weights in {dtype}. Source checkpoint: `{path}`.", "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)  # or `import megaflex.hf` first",
        "tok = AutoTokenizer.from_pretrained(DIR)",
        "```", "",
        "Decoding carries megaflex's recurrent state as the cache (constant memory per token for linear kinds)."
        if causal else "Every position reads every token, so it is no language model: `model(ids)` returns its "
        "logits, `generate()` and a cache are refused.",
        "Left padding is not supported; pad on the right.", "",
        "## Evaluation", "",
    ]
    if evals:
        lines += ["| data | mode | context | ppl | bits/byte | word ppl | tokens |", "|---|---|---:|---:|---:|---:|---:|"]
        for r in evals:
            bpb, wppl = r.get("bits_per_byte"), r.get("word_ppl")
            lines.append(f"| {r.get('data', '?')} | {r.get('mode')} | {r.get('context')} | {r['ppl']:.3f} | "
                         f"{'-' if bpb is None else f'{bpb:.4f}'} | {'-' if wppl is None else f'{wppl:.3f}'} | {r.get('tokens')} |")
        lines.append("")
        lines.append("Numbers from `megaflex-eval --json` on the source checkpoint.")
    else:
        lines.append("No evaluation results were given to the export (`--eval-json`).")
    lines += ["", "## Training config", "", "```yaml", yaml.safe_dump(run_config, sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megaflex-export", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="checkpoint folder, checkpoint.dir or run dir (export to HF)")
    p.add_argument("--hf-out", help="output Hugging Face model directory")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--tag", default=None, help="checkpoint tag (default latest)")
    p.add_argument("--tokenizer", default=None, help="tokenizer file: sentencepiece .model or tokenizer.json (default: data.tokenizer of the run)")
    p.add_argument("--eval-json", nargs="*", type=existing_file, default=[],
                   help="megaflex-eval --json results for the model card")
    p.add_argument("--from-hf", default=None, help="Hugging Face model directory to convert back (import)")
    p.add_argument("--megaflex-out", default=None, help="new checkpoint.dir to write the imported model into "
                   "(never a training run's)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --hf-out / --megaflex-out")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``megaflex-export``: 0 when written, 2 on bad input (one ``error:`` line)."""
    from megaflex.eval.loading import USER_ERRORS

    p = build_parser()
    args = p.parse_args(argv)
    if args.from_hf:
        if not args.megaflex_out or args.checkpoint or args.hf_out:
            p.error("--from-hf DIR needs --megaflex-out OUT (and no --checkpoint/--hf-out)")
    elif not args.checkpoint or not args.hf_out:
        p.error("export needs --checkpoint RUN_OR_CKPT and --hf-out DIR (or --from-hf DIR --megaflex-out OUT)")
    try:
        if args.from_hf:
            out = import_hf(args.from_hf, args.megaflex_out, overwrite=args.overwrite)
        else:
            out = export_checkpoint(args.checkpoint, args.hf_out, dtype=args.dtype, tag=args.tag,
                                    tokenizer=args.tokenizer, eval_json=args.eval_json, overwrite=args.overwrite)
    except USER_ERRORS as e:
        print(f"megaflex-export: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
