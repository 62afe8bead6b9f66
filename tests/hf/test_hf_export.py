"""megaflex-export on a real TP=2 / ZeRO-3 checkpoint: HF model, remote code, round trip, lm-eval.

One tiny run (2 steps, 2 gloo ranks, tensor parallel 2, ZeRO stage 3) with the training
arguments of test_eval_cli, exported once; every test reads that export. The remote-code and lm-eval
tests read one process that runs the export without megaflex.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distributed import run_distributed
from failure_helpers import one_error_line
from megaflex.hf.export import export_checkpoint, import_hf
from megaflex.hf.export import main as export_main
from megaflex.eval.loading import load_for_eval
from numerics import assert_close, gpt_steps
from training_harness import tiny_eval_train_args, train_rank

REPO = Path(__file__).resolve().parents[2]
PROMPT = "The history of the"


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_export")
    data = root / "data"
    data.mkdir()
    raw = (shared_data / "wikitext-2-raw" / "wiki.valid.raw").read_text(encoding="utf-8")
    (data / "train.raw").write_text(raw[:150_000], encoding="utf-8")
    py = sys.executable
    subprocess.run([py, "-m", "data_prep.train_tokenizer", "--input", str(data / "train.raw"), "--vocab-size", "512",
                    "--output-prefix", str(data / "tok")], check=True, cwd=REPO, capture_output=True)
    subprocess.run([py, "-m", "data_prep.preprocess", "--input", str(data / "train.raw"), "--tokenizer",
                    str(data / "tok.model"), "--output-prefix", str(data / "train"), "--no-progress"],
                   check=True, cwd=REPO, capture_output=True)
    for split in ("test.bin", "test.idx"):  # the run's valid_path: eval is off, the files only need to exist
        shutil.copyfile(data / split.replace("test", "train"), data / split)
    run = root / "z3tp2"
    assert run_distributed(train_rank, 2, args=(tiny_eval_train_args(data, run, 3, 2),), init_process_group=False) == [0, 0]
    from megaflex.eval.perplexity import run_cli

    run_cli(["--checkpoint", str(run), "--data", str(data / "train.raw"), "--max-tokens", "400", "--context", "64",
             "--device", "cpu", "--json", str(root / "ppl.json")])
    hf = export_checkpoint(run, root / "hf", eval_json=[root / "ppl.json"])
    return {"root": root, "data": data, "run": run, "hf": hf}


@pytest.mark.slow
def test_tp2_zero3_export_loads_with_auto_classes_and_matches_megaflex(exported: dict[str, Path]) -> None:
    import megaflex.hf  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = exported["hf"]
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer.model",
                 "README.md", "modeling_flexformer.py", "configuration_flexformer.py", "megaflex_bundle.py"):
        assert (hf / name).is_file(), name
    card = (hf / "README.md").read_text()
    assert "tensor parallel 2, ZeRO stage 3" in card and "zero_stage: 3" in card
    ppl = json.loads((exported["root"] / "ppl.json").read_text())["ppl"]
    assert f"| {ppl:.3f} |" in card  # the eval numbers given with --eval-json
    reference = load_for_eval(exported["run"])
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(hf)
    text = (exported["data"] / "train.raw").read_text()[:3000]
    ids = torch.tensor([reference.tokenizer.encode(text)[:200]])
    assert tok(text, add_special_tokens=False).input_ids == reference.tokenizer.encode(text)  # same tokenizer
    with torch.no_grad():
        expected = reference.model.gather_logits(reference.model(ids).logits)
        got = model(ids).logits
    assert_close(got, expected, steps=gpt_steps(reference.model.config, ids.shape[-1]))


@pytest.mark.slow
def test_greedy_generate_equals_megaflex_generate_cli(exported: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    import megaflex.hf  # noqa: F401
    from megaflex.eval.generate import main as generate_main
    from transformers import AutoModelForCausalLM, AutoTokenizer

    generate_main(["--checkpoint", str(exported["run"]), "--prompt", PROMPT, "--max-new-tokens", "20",
                   "--temperature", "0"])
    megaflex_text = capsys.readouterr().out.rstrip("\n")
    model = AutoModelForCausalLM.from_pretrained(exported["hf"]).eval()
    tok = AutoTokenizer.from_pretrained(exported["hf"])
    prompt = tok(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert out.shape[1] == prompt.shape[1] + 20
    assert tok.decode(out[0]) == megaflex_text


@pytest.mark.slow
def test_round_trip_megaflex_hf_megaflex_is_bit_identical(exported: dict[str, Path], tmp_path: Path) -> None:
    assert export_main(["--from-hf", str(exported["hf"]), "--megaflex-out", str(tmp_path / "back")]) == 0
    original, back = load_for_eval(exported["run"]), load_for_eval(tmp_path / "back")
    assert back.model.config == original.model.config
    assert back.meta.iteration == original.meta.iteration
    a, b = original.model.state_dict(), back.model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert back.tokenizer is not None and back.tokenizer.encode(PROMPT) == original.tokenizer.encode(PROMPT)


@pytest.mark.slow
def test_bf16_export(exported: dict[str, Path], tmp_path: Path) -> None:
    import megaflex.hf  # noqa: F401
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    export_main(["--checkpoint", str(exported["run"]), "--hf-out", str(tmp_path / "bf16"), "--dtype", "bf16"])
    weights = load_file(tmp_path / "bf16" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    fp32 = load_file(exported["hf"] / "model.safetensors")
    assert all(torch.equal(weights[k], fp32[k].to(torch.bfloat16)) for k in fp32)  # rounded once, nothing else
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").eval()
    assert model.dtype == torch.bfloat16
    import_hf(tmp_path / "bf16", tmp_path / "back")  # back as fp32 holding the bf16 values exactly
    back = load_for_eval(tmp_path / "back").model.state_dict()
    assert all(torch.equal(back[k[len("model."):]], fp32[k].to(torch.bfloat16).float()) for k in fp32)


# One process without megaflex on its path runs the exported remote code: AutoModelForCausalLM
# (trust_remote_code) logits and greedy tokens of fixed ids, then lm-eval's harness on the local task:
# what ``lm_eval --model hf --model_args pretrained=HF,trust_remote_code=True,dtype=float32 --include_path
# TASKS --tasks megaflex_wikitext2 --batch_size 4 --device cpu`` runs (simple_evaluate on the task found
# under --include_path), minus the CLI's indexing of lm-eval's ~14,000 built-in task files (~10 s).
_REMOTE = """
import sys
sys.modules["megaflex"] = None  # an installed megaflex must not be used
import torch
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from transformers import AutoModelForCausalLM
hf, ids_file, tasks, out = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(hf, trust_remote_code=True).eval()
ids = torch.load(ids_file)
with torch.no_grad():
    logits = model(ids).logits
generated = model.generate(ids[:, :8], max_new_tokens=6, do_sample=False, eos_token_id=None)
lm = simple_evaluate(model="hf", model_args=f"pretrained={hf},trust_remote_code=True,dtype=float32",
                     tasks=["megaflex_wikitext2"], task_manager=TaskManager(include_path=tasks, include_defaults=False),
                     batch_size=4, device="cpu")["results"]["megaflex_wikitext2"]
assert not [m for m in sys.modules if m.startswith("megaflex.") or m == "megaflex" and sys.modules[m]]
torch.save({"logits": logits, "generated": generated, "module": type(model).__module__, "lm_eval": lm}, out)
"""


@pytest.fixture(scope="module")
def remote(exported: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> dict:
    """The ``_REMOTE`` process's results, its ids and the lm-eval task's JSONL."""
    from megaflex.hf.lm_eval_tasks import main as tasks_main

    root = tmp_path_factory.mktemp("remote")
    tasks = root / "tasks"
    assert tasks_main(["--out", str(tasks), "--hf-model", str(exported["hf"]), "--max-docs", "1",
                       "--data", str(shared_data / "wikitext-2-raw" / "wiki.test.raw")]) == 0
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    torch.save(ids, root / "ids.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_CACHE=str(root / "datasets"), HF_MODULES_CACHE=str(root / "modules"))
    proc = subprocess.run([sys.executable, "-c", _REMOTE, str(exported["hf"]), str(root / "ids.pt"), str(tasks),
                           str(root / "out.pt")], cwd=root, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"ids": ids, "jsonl": tasks / "megaflex_wikitext2.jsonl", **torch.load(root / "out.pt")}


@pytest.mark.slow
def test_trust_remote_code_without_megaflex(exported: dict[str, Path], remote: dict) -> None:
    assert remote["module"].startswith("_megaflex_bundle_")
    ids = remote["ids"]
    reference = load_for_eval(exported["run"]).model
    with torch.no_grad():
        expected = reference.gather_logits(reference(ids).logits)
    assert_close(remote["logits"], expected, steps=gpt_steps(reference.config, ids.shape[-1]))
    from megaflex.eval.generate import SamplingConfig, generate

    assert torch.equal(remote["generated"][:, 8:], generate(reference, ids[:, :8], 6, SamplingConfig(temperature=0)))


@pytest.mark.slow
def test_lm_eval_local_task_perplexity_matches_megaflex_eval(exported: dict[str, Path], remote: dict) -> None:
    from megaflex.eval.perplexity import run_cli

    records = [json.loads(line) for line in remote["jsonl"].read_text().splitlines()]
    assert len(records) > 2 and max(r["num_tokens"] for r in records) <= 256  # cut to the model's max_seq_len
    lm = remote["lm_eval"]  # lm-eval ran the exported remote code, without megaflex
    ours = run_cli(["--checkpoint", str(exported["run"]), "--data", str(remote["jsonl"]), "--mode", "windows",
                    "--context", "256", "--device", "cpu"])
    assert ours["tokens"] == sum(r["num_tokens"] for r in records)  # both score exactly these targets
    assert lm["token_perplexity,none"] == pytest.approx(ours["ppl"], rel=1e-3)
    assert lm["word_perplexity,none"] == pytest.approx(ours["word_ppl"], rel=1e-3)
    assert lm["bits_per_byte,none"] == pytest.approx(ours["bits_per_byte"], rel=1e-3)


def _export_error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """megaflex-export's one `error:` line for ``argv`` (exit status 2, no traceback)."""
    capsys.readouterr()
    assert export_main(argv) == 2
    return one_error_line(capsys.readouterr().err, "megaflex-export")


@pytest.mark.slow
def test_clear_errors(exported: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    empty = tmp_path / "no_model"
    empty.mkdir()
    assert "checkpoint: expected a checkpoint folder" in _export_error(
        ["--checkpoint", str(empty), "--hf-out", str(tmp_path / "x")], capsys)
    assert re.search("--tokenizer: tokenizer model .*missing.model.* not found", _export_error(
        ["--checkpoint", str(exported["run"]), "--hf-out", str(tmp_path / "y"), "--tokenizer", str(tmp_path / "missing.model")],
        capsys))
    assert "tag: 'step_00000099' is not a complete checkpoint" in _export_error(
        ["--checkpoint", str(exported["run"]), "--tag", "step_00000099", "--hf-out", str(tmp_path / "t")], capsys)
    with pytest.raises(ValueError, match="--from-hf: expected a Hugging Face model directory"):
        import_hf(empty, tmp_path / "z")
    bad = tmp_path / "bad_hf"
    shutil.copytree(exported["hf"], bad)
    config = json.loads((bad / "config.json").read_text())
    config["attention"] = "mystery"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="attention must be one of .*'mystery'"):
        import_hf(bad, tmp_path / "z")
    no_shard = tmp_path / "no_shard"
    shutil.copytree(exported["hf"], no_shard)
    (no_shard / "model.safetensors").unlink()
    assert "holds no weights" in _export_error(["--from-hf", str(no_shard), "--megaflex-out", str(tmp_path / "w")], capsys)
    (no_shard / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    assert "shard " + str(no_shard / "model-00001-of-00002.safetensors") + " listed in model.safetensors.index.json is missing" \
        in _export_error(["--from-hf", str(no_shard), "--megaflex-out", str(tmp_path / "w")], capsys)
    assert not (tmp_path / "w").exists()  # refused before anything was written


@pytest.mark.slow
def test_truncated_checkpoint_metadata_is_one_error_line(exported: dict[str, Path], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    from megaflex.eval.generate import main as generate_main
    from megaflex.eval.perplexity import main as eval_main

    run = tmp_path / "run"
    shutil.copytree(exported["run"] / "checkpoints", run)
    tag = next(p for p in run.iterdir() if p.name.startswith("step_"))
    meta = tag / "megaflex.json"
    meta.write_bytes(meta.read_bytes()[:200])
    for prog, main, argv in (
        ("megaflex-export", export_main, ["--checkpoint", str(run), "--hf-out", str(tmp_path / "hf")]),
        ("megaflex-generate", generate_main, ["--checkpoint", str(tag), "--prompt", PROMPT]),
        ("megaflex-eval", eval_main, ["--checkpoint", str(tag), "--data", str(exported["data"] / "train.raw")]),
    ):
        capsys.readouterr()
        assert main(argv) == 2, prog
        err = one_error_line(capsys.readouterr().err, prog)
        assert err.startswith(f"{prog}: error: corrupt checkpoint file {meta}: not valid JSON"), err


@pytest.mark.slow
def test_export_never_writes_where_it_does_not_own(exported: dict[str, Path], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    users = tmp_path / "users_dir"
    users.mkdir()
    (users / "README.md").write_text("mine")
    (users / "notes.txt").write_text("also mine")
    (users / "notes.txt").chmod(0o600)
    argv = ["--checkpoint", str(exported["run"]), "--hf-out", str(users)]
    assert "--hf-out " + str(users) + ": the directory is not empty (holds README.md, notes.txt); pass --overwrite" \
        in _export_error(argv, capsys)
    assert (users / "README.md").read_text() == "mine" and sorted(p.name for p in users.iterdir()) == ["README.md", "notes.txt"]
    old_umask = os.umask(0o027)
    try:
        assert export_main(argv + ["--overwrite"]) == 0
    finally:
        os.umask(old_umask)
    assert (users / "README.md").read_text() != "mine"
    assert (users / "notes.txt").stat().st_mode & 0o777 == 0o600  # not written: left as it was
    for path in users.rglob("*"):  # what the export wrote: the user's umask, not safetensors' 0600
        if path.name != "notes.txt":
            assert path.stat().st_mode & 0o777 == (0o750 if path.is_dir() else 0o640), path
    # a training run's checkpoint folder (or its run dir) is refused even with --overwrite
    for target in (exported["run"] / "checkpoints", exported["run"]):
        before = sorted(p.name for p in target.iterdir())
        err = _export_error(["--from-hf", str(exported["hf"]), "--megaflex-out", str(target), "--overwrite"], capsys)
        assert "refusing to write into a training run's checkpoint folder" in err
        assert sorted(p.name for p in target.iterdir()) == before
    back = tmp_path / "back"
    assert export_main(["--from-hf", str(exported["hf"]), "--megaflex-out", str(back)]) == 0
    assert "--megaflex-out " + str(back) + ": the directory is not empty" in _export_error(
        ["--from-hf", str(exported["hf"]), "--megaflex-out", str(back)], capsys)
    assert export_main(["--from-hf", str(exported["hf"]), "--megaflex-out", str(back), "--overwrite"]) == 0
    config = json.loads((exported["hf"] / "config.json").read_text())
    assert config["tokenizer_vocab_size"] == 512 and config["vocab_size"] >= 512
