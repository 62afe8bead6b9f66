"""LRA loaders (issue 41): the fixed ListOps vocabulary, byte-level Text (aclImdb, JSONL) and
Retrieval (AAN TSV) on tiny fixtures in the real files' formats, malformed files, truncation,
padding and batching."""

from __future__ import annotations

import functools
import json
import pickle
from pathlib import Path

import pytest
import torch

from megaflex.data import DataError
from megaflex.data.lra import (
    BYTE_OFFSET,
    BYTE_VOCAB_SIZE,
    CLS_ID,
    LISTOPS_TOKEN_TO_ID,
    LISTOPS_VOCAB,
    PAD_ID,
    UNK_ID,
    ListOpsDataset,
    LRAFormatError,
    RetrievalBytesDataset,
    TextBytesDataset,
    aan_path,
    collate_lra,
    decode_bytes,
    decode_listops,
    encode_bytes,
    encode_listops,
    listops_path,
    read_listops_tsv,
    text_path,
)

# MAX(2, 9, MIN(4, 7), 0) = 9 in LRA's file form, and SM(3, 8) = 1
LRA_ROW = "( ( ( ( ( [MAX 2 ) 9 ) ( ( ( [MIN 4 ) 7 ) ] ) ) 0 ) ] )"
SM_ROW = "( ( ( [SM 3 ) 8 ) ] )"


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return path


def listops_file(tmp_path: Path, rows: list[tuple[str, str]], header: str = "Source\tTarget") -> Path:
    return write(tmp_path / "basic_train.tsv", header + "\n" + "".join(f"{s}\t{t}\n" for s, t in rows))


# ---------------------------------------------------------------- ListOps


def test_listops_vocabulary_is_fixed():
    assert len(LISTOPS_VOCAB) == 20 and LISTOPS_VOCAB[:3] == ("<pad>", "<cls>", "<unk>")
    assert (PAD_ID, CLS_ID, UNK_ID) == (0, 1, 2)
    assert [LISTOPS_TOKEN_TO_ID[t] for t in ("0", "9", "[MIN", "[MAX", "[MED", "[SM", "]", "(", ")")] == \
        [3, 12, 13, 14, 15, 16, 17, 18, 19]


def test_listops_encode_round_trip_and_parens():
    ids = encode_listops(LRA_ROW, keep_parens=True)
    assert decode_listops(ids) == LRA_ROW and len(ids) == len(LRA_ROW.split())
    no_parens = encode_listops(LRA_ROW)
    assert decode_listops(no_parens) == "[MAX 2 9 [MIN 4 7 ] 0 ]"  # ] kept: still unambiguous
    assert decode_listops(torch.tensor(no_parens + [PAD_ID, PAD_ID])) == "[MAX 2 9 [MIN 4 7 ] 0 ]"


@pytest.mark.parametrize("bad", ["[MAX 2 [FIRST 3 ] ]", "[MIN3 4 ]", "[MAX 2 10 ]", "<pad> 2", "\x01 2", "( a )"])
def test_listops_unknown_tokens(bad: str):
    with pytest.raises(LRAFormatError, match="unknown ListOps token"):
        encode_listops(bad)
    assert UNK_ID in encode_listops(bad, strict=False)


def test_read_listops_tsv(tmp_path: Path):
    path = listops_file(tmp_path, [(LRA_ROW, "9"), (SM_ROW, "1")])
    assert listops_path(tmp_path, "train") == path and listops_path(tmp_path, "valid").name == "basic_val.tsv"
    rows = read_listops_tsv(path)
    assert [(decode_listops(i), y) for i, y in rows] == [("[MAX 2 9 [MIN 4 7 ] 0 ]", 9), ("[SM 3 8 ]", 1)]
    assert decode_listops(read_listops_tsv(path, keep_parens=True)[1][0]) == SM_ROW


@pytest.mark.parametrize("rows,header,match", [
    ([(LRA_ROW, "9")], "Source Target", "header"),
    ([(LRA_ROW, "9\textra")], "Source\tTarget", ":2: expected 2 tab-separated"),
    ([(SM_ROW, "1"), (LRA_ROW, "nine")], "Source\tTarget", ":3: label 'nine' is not a number"),
    ([(LRA_ROW, "12")], "Source\tTarget", r"not an integer in \[0, 10\)"),
    ([(LRA_ROW, "1.5")], "Source\tTarget", "not an integer"),
    ([("  ", "1")], "Source\tTarget", "empty Source"),
    ([("[MAX 2 [FIRST 1 ] ]", "2")], "Source\tTarget", ":2: unknown ListOps token '\\[FIRST'"),
])
def test_listops_malformed(tmp_path: Path, rows, header, match):
    path = listops_file(tmp_path, rows, header)
    with pytest.raises(LRAFormatError, match=match):
        read_listops_tsv(path)
    with pytest.raises(DataError, match=match):  # the dataset reports the same, a DataError
        ListOpsDataset(path)


def test_listops_missing_file(tmp_path: Path):
    with pytest.raises(LRAFormatError, match="data_prep.listops"):
        ListOpsDataset(tmp_path / "basic_train.tsv")
    with pytest.raises(LRAFormatError, match="no examples"):
        ListOpsDataset(listops_file(tmp_path, []))


def test_listops_dataset_items_truncation_cls(tmp_path: Path):
    path = listops_file(tmp_path, [(LRA_ROW, "9"), (SM_ROW, "1")])
    ds = ListOpsDataset(path)
    assert len(ds) == 2 and ds.num_truncated == 0 and ds.lengths.tolist() == [9, 4]
    item = ds[0]
    assert item["input_ids"].dtype == torch.int64 and item["attention_mask"].dtype == torch.bool
    assert decode_listops(item["input_ids"]) == "[MAX 2 9 [MIN 4 7 ] 0 ]" and item["label"].item() == 9
    assert item["attention_mask"].all() and item["label"].shape == ()
    short = ListOpsDataset(path, max_len=5, add_cls=True)
    assert short.num_truncated == 1  # the 9-token row; the 4-token row + <cls> fits
    assert short[0]["input_ids"].tolist() == [CLS_ID] + encode_listops(LRA_ROW)[:4]
    assert short[1]["input_ids"].tolist() == [CLS_ID] + encode_listops(SM_ROW)
    assert len(ListOpsDataset(path, keep_parens=True)[1]["input_ids"]) == 10
    with pytest.raises(ValueError, match="max_len"):
        ListOpsDataset(path, max_len=0)


# ---------------------------------------------------------------- bytes, Text


def test_byte_encoding():
    text = "naïve €5"
    ids = encode_bytes(text)
    assert ids.tolist() == [b + BYTE_OFFSET for b in text.encode("utf-8")] and len(ids) == 11
    assert int(ids.max()) < BYTE_VOCAB_SIZE and int(ids.min()) >= BYTE_OFFSET
    assert decode_bytes(torch.from_numpy(ids.astype("int64"))) == text
    assert decode_bytes([CLS_ID, *ids.tolist(), PAD_ID]) == text


REVIEWS = {
    ("train", "pos", "0_9.txt"): "A great film.<br /><br />Loved it — 10/10",
    ("train", "pos", "1_8.txt"): "Fine",
    ("train", "neg", "0_2.txt"): "Awful. Überlang.",
    ("test", "neg", "5_1.txt"): "bad",
    ("test", "pos", "3_7.txt"): "good",
}


@pytest.fixture
def acl_dir(tmp_path: Path) -> Path:
    root = tmp_path / "aclImdb"
    for (split, label, name), text in REVIEWS.items():
        write(root / split / label / name, text)
    write(root / "train" / "unsup" / "0_0.txt", "ignored")
    write(root / "train" / "urls_pos.txt", "http://ignored")
    return root


def test_text_aclimdb(acl_dir: Path):
    ds = TextBytesDataset(acl_dir, "train")
    assert len(ds) == 3 and ds.labels.tolist() == [0, 1, 1]  # neg then pos, each sorted by file name
    texts = [decode_bytes(ds[i]["input_ids"]) for i in range(3)]
    assert texts == [REVIEWS["train", "neg", "0_2.txt"], REVIEWS["train", "pos", "0_9.txt"],
                     REVIEWS["train", "pos", "1_8.txt"]]
    assert [ds[i]["label"].item() for i in range(3)] == [0, 1, 1]
    test = TextBytesDataset(acl_dir, "test")
    assert [decode_bytes(test[i]["input_ids"]) for i in range(2)] == ["bad", "good"]


def test_text_truncation_bytes_not_chars(acl_dir: Path):
    ds = TextBytesDataset(acl_dir, "train", max_len=7, add_cls=True)
    item = ds[0]  # "Awful. Überlang.": <cls> + 6 bytes
    assert item["input_ids"].tolist() == [CLS_ID] + encode_bytes(b"Awful.").tolist()
    assert len(item["attention_mask"]) == 7
    cut = TextBytesDataset(acl_dir, "train", max_len=8)[0]["input_ids"]  # ends inside "Ü" (2 bytes)
    assert len(cut) == 8 and decode_bytes(cut) == "Awful. \ufffd"


def test_text_errors(acl_dir: Path, tmp_path: Path):
    with pytest.raises(LRAFormatError, match="aclImdb"):
        TextBytesDataset(tmp_path / "nowhere")
    with pytest.raises(LRAFormatError, match=r"test/pos: missing"):
        (acl_dir / "test" / "pos" / "3_7.txt").unlink()
        (acl_dir / "test" / "pos").rmdir()
        TextBytesDataset(acl_dir, "test")
    with pytest.raises(ValueError, match="'train' and 'test'"):
        TextBytesDataset(acl_dir, "valid")
    with pytest.raises(LRAFormatError, match="directory or a .jsonl"):
        TextBytesDataset(write(tmp_path / "x.tsv", "a\t1\n"))
    write(acl_dir / "train" / "neg" / "9_1.txt", b"caf\xe9")  # Latin-1, not UTF-8
    with pytest.raises(LRAFormatError, match="9_1.txt: not UTF-8"):
        TextBytesDataset(acl_dir, "train")[1]


def test_text_jsonl(tmp_path: Path):
    rows = [{"text": "good\tfilm\n", "label": 1}, {"text": "bad", "label": 0}]
    path = write(tmp_path / "imdb_train.jsonl", "".join(json.dumps(r) + "\n" for r in rows) + "\n")
    ds = TextBytesDataset(path)
    assert len(ds) == 2 and [decode_bytes(ds[i]["input_ids"]) for i in range(2)] == ["good\tfilm\n", "bad"]
    assert [ds[i]["label"].item() for i in range(2)] == [1, 0]
    for bad, match in (('{"text": "x", "label": 2}', ":2: label '2' is not an integer in"),
                       ('{"text": "x"', ":2: not JSON"), ('{"review": "x", "label": 1}', "string 'text'")):
        path = write(tmp_path / "bad.jsonl", json.dumps(rows[0]) + "\n" + bad + "\n")
        with pytest.raises(LRAFormatError, match=match):
            TextBytesDataset(path)


def test_text_counts_the_rows_it_truncates_and_names_its_source(acl_dir: Path, tmp_path: Path):
    """Bytes, not characters; <cls> counts towards max_len (the count classify prints per split)."""
    lengths = sorted(len(t.encode()) for (split, _, _), t in REVIEWS.items() if split == "train")
    assert lengths == [4, 17, 43]
    assert TextBytesDataset(acl_dir, "train", max_len=17).num_truncated == 1
    assert TextBytesDataset(acl_dir, "train", max_len=17, add_cls=True).num_truncated == 2
    assert TextBytesDataset(acl_dir, "train").num_truncated == 0
    assert TextBytesDataset(acl_dir, "test").source == str(acl_dir / "test")
    rows = [{"text": "é" * 3, "label": 1}, {"text": "abcdef", "label": 0}]  # 6 bytes each
    path = write(tmp_path / "train.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    assert TextBytesDataset(path, max_len=5).num_truncated == 2 and TextBytesDataset(path, max_len=6).num_truncated == 0
    assert TextBytesDataset(path).source == str(path)


def test_text_path_finds_each_split_in_a_folder(acl_dir: Path, tmp_path: Path):
    """valid.jsonl when there is one, else the test split (LRA's protocol); aclImdb: its folders."""
    assert [text_path(acl_dir, s) for s in ("train", "valid", "test")] == [(acl_dir, "train"), (acl_dir, "test"),
                                                                          (acl_dir, "test")]  # fmt: skip
    for split in ("train", "test"):
        write(tmp_path / f"{split}.jsonl", "")
    assert text_path(tmp_path, "valid") == (tmp_path / "test.jsonl", "test")
    write(tmp_path / "valid.jsonl", "")
    assert text_path(tmp_path, "valid") == (tmp_path / "valid.jsonl", "valid")
    assert text_path(tmp_path, "train") == (tmp_path / "train.jsonl", "train")
    with pytest.raises(ValueError, match="split"):
        text_path(tmp_path, "dev")


def test_text_hint_names_a_folder_of_splits_not_one_file(tmp_path: Path):
    with pytest.raises(LRAFormatError) as error:
        TextBytesDataset(tmp_path / "nowhere")
    assert "a folder of train.jsonl and test.jsonl" in str(error.value) and "or a .jsonl file" not in str(error.value)


# ---------------------------------------------------------------- Retrieval (AAN)

AAN_ROWS = [
    ("1.0", "P05-1001", "W04-3201", "We present a parser. Σ", "A 'quoted\" abstract"),
    ("0.0", "J93-2004", "P02-1040", "BLEU" * 5, "short"),
    ("1", "A00-1001", "A00-1002", "x", "y"),
]


def aan_file(directory: Path, split: str = "eval", rows=AAN_ROWS) -> Path:
    return write(directory / f"new_aan_pairs.{split}.tsv", "".join("\t".join(r) + "\n" for r in rows))


def test_retrieval_reads_lra_format(tmp_path: Path):
    path = aan_file(tmp_path)
    assert aan_path(tmp_path, "valid") == path == aan_path(tmp_path, "eval")
    ds = RetrievalBytesDataset(tmp_path, "valid")
    assert len(ds) == 3 and ds.labels.tolist() == [1, 0, 1]
    assert ds.row(0)["id2"] == b"W04-3201" and ds.row(0)["text2"] == b"A 'quoted\" abstract"  # quotes literal
    item = ds[0]
    assert set(item) == {"input_ids_1", "attention_mask_1", "input_ids_2", "attention_mask_2", "label"}
    assert decode_bytes(item["input_ids_1"]) == AAN_ROWS[0][3] and decode_bytes(item["input_ids_2"]) == AAN_ROWS[0][4]
    assert RetrievalBytesDataset(path).labels.tolist() == [1, 0, 1]  # the file itself works too


def test_retrieval_truncates_each_document(tmp_path: Path):
    ds = RetrievalBytesDataset(aan_file(tmp_path, "test"), max_len=6)
    item = ds[1]
    assert decode_bytes(item["input_ids_1"]) == "BLEUBL" and decode_bytes(item["input_ids_2"]) == "short"
    assert item["attention_mask_1"].shape == (6,) and item["attention_mask_2"].shape == (5,)
    # a row counts once when either document is cut: row 0 (both texts > 6 bytes), row 1 ("BLEU" * 5)
    assert ds.num_truncated == 2 and ds.source == str(aan_file(tmp_path, "test"))
    assert RetrievalBytesDataset(aan_file(tmp_path, "test"), max_len=20, add_cls=True).num_truncated == 2
    assert RetrievalBytesDataset(aan_file(tmp_path, "test"), max_len=23).num_truncated == 0


@pytest.mark.parametrize("line,match", [
    ("1.0\tA\tB\tonly four", ":2: expected 5 tab-separated fields"),
    ("label\tid1\tid2\ttext1\ttext2", ":2: label 'label' is not a number"),
    ("2.0\tA\tB\tt1\tt2", r"label '2.0' is not an integer in \[0, 2\)"),
    ("yes\tA\tB\tt1\tt2", "not a number"),
    ("1.0\tA\tB\tt1\ttab\tinside", "got 6"),
])
def test_retrieval_malformed(tmp_path: Path, line: str, match: str):
    write(tmp_path / "new_aan_pairs.train.tsv", "\t".join(AAN_ROWS[0]) + "\n" + line + "\n")
    with pytest.raises(LRAFormatError, match=match):
        RetrievalBytesDataset(tmp_path, "train")


def test_retrieval_keeps_raw_bytes(tmp_path: Path):
    write(tmp_path / "new_aan_pairs.train.tsv", b"0.0\tA\tB\tcaf\xe9\tok\r\n")  # Latin-1 byte, CRLF
    item = RetrievalBytesDataset(tmp_path, "train")[0]
    assert item["input_ids_1"].tolist() == [b + BYTE_OFFSET for b in b"caf\xe9"]
    assert decode_bytes(item["input_ids_2"]) == "ok"


def test_retrieval_header_hint_and_missing(tmp_path: Path):
    write(tmp_path / "new_aan_pairs.train.tsv", "label\tid1\tid2\ttext\n")
    with pytest.raises(LRAFormatError, match="a header line"):
        RetrievalBytesDataset(tmp_path, "train")
    with pytest.raises(LRAFormatError, match=r"new_aan_pairs.test.tsv: no such file; .*lra_release"):
        RetrievalBytesDataset(tmp_path, "test")
    with pytest.raises(ValueError, match="split"):
        RetrievalBytesDataset(tmp_path, "dev")


# ---------------------------------------------------------------- batching


def test_collate_pads_to_longest_and_fixed(tmp_path: Path):
    ds = ListOpsDataset(listops_file(tmp_path, [(LRA_ROW, "9"), (SM_ROW, "1")]))
    batch = collate_lra([ds[0], ds[1]])
    assert batch["input_ids"].shape == (2, 9) and batch["label"].tolist() == [9, 1]
    assert batch["attention_mask"].sum(1).tolist() == [9, 4]
    assert (batch["input_ids"][1, 4:] == PAD_ID).all() and not batch["attention_mask"][1, 4:].any()
    loader = torch.utils.data.DataLoader(ds, batch_size=2, collate_fn=functools.partial(collate_lra, pad_to=12))
    fixed = next(iter(loader))
    assert fixed["input_ids"].shape == (2, 12) and fixed["attention_mask"].dtype == torch.bool
    assert torch.equal(fixed["input_ids"][:, :9], batch["input_ids"])
    with pytest.raises(ValueError, match="pad_to=4"):
        collate_lra([ds[0]], pad_to=4)


def test_collate_pairs(tmp_path: Path):
    ds = RetrievalBytesDataset(aan_file(tmp_path))
    batch = collate_lra([ds[i] for i in range(3)], pad_to=32)
    assert batch["input_ids_1"].shape == batch["input_ids_2"].shape == (3, 32)
    assert batch["attention_mask_2"].sum(1).tolist() == [len(r[4].encode()) for r in AAN_ROWS]
    assert batch["label"].tolist() == [1, 0, 1]


def test_datasets_pickle_for_workers(tmp_path: Path, acl_dir: Path):
    """DataLoader workers receive the dataset pickled (spawn/forkserver): no closures or open files."""
    jsonl = write(tmp_path / "t.jsonl", json.dumps({"text": "ok", "label": 1}) + "\n")
    sets = [ListOpsDataset(listops_file(tmp_path, [(SM_ROW, "1")])), TextBytesDataset(acl_dir),
            TextBytesDataset(jsonl), RetrievalBytesDataset(aan_file(tmp_path))]
    for ds in sets:
        ds[0]  # opens the file where the dataset reads lazily
        copy = pickle.loads(pickle.dumps(ds))
        assert all(torch.equal(a, b) for a, b in zip(copy[0].values(), ds[0].values()))
