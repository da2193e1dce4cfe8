"""PackedTokens: every document token in exactly one row, labels never across documents, and one
clear error per bad input. Documents are made of ids ``1000 * document + offset``, so a row says
by itself where each of its tokens came from."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gpuload
from gpuload.datasets.packing import IGNORE_INDEX, PackedTokens, collate_packed
from gpuload.datasets.tokens import TokenFileError, write_shard

SEQ_LEN = 32


def _lengths(count: int, seed: int = 0, mean: float = 2.5, high: int = 90) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(n) for n in np.clip(rng.lognormal(mean, 1.0, size=count), 1, high)]


def _documents(lengths: Sequence[int]) -> list[np.ndarray]:
    return [1000 * d + np.arange(n) for d, n in enumerate(lengths)]


def _everything(ds: PackedTokens) -> dict[str, Any]:
    return collate_packed([ds[i] for i in range(len(ds))])


def _check(ds: PackedTokens, lengths: Sequence[int], prompts: Sequence[int] | None = None,
           pad_id: int = 0) -> dict[int, list[int]]:
    """Check every invariant of the rows; return each document's offsets as packed, in row order."""
    batch = _everything(ds)
    ids, labels, positions = batch["input_ids"], batch["labels"], batch["position_ids"]
    cu = batch["cu_seqlens"]
    assert ids.dtype == labels.dtype == positions.dtype == torch.int64 and cu.dtype == torch.int32
    assert ids.shape == (len(ds), ds.seq_len) and cu[-1] == ids.numel()
    assert batch["max_seqlen"] == int((cu[1:] - cu[:-1]).max()) <= ds.seq_len
    seen: dict[int, list[int]] = {}
    flat_ids, flat_labels = ids.reshape(-1), labels.reshape(-1)
    for begin, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        assert begin // ds.seq_len == (end - 1) // ds.seq_len, "a segment crosses a row"
        assert positions.reshape(-1)[begin:end].tolist() == list(range(end - begin))
        segment = flat_ids[begin:end]
        fill = int(ds.plan.row_fill[begin // ds.seq_len])
        if begin % ds.seq_len == fill:  # the row's padding, after its documents
            assert end % ds.seq_len == 0 or end == ids.numel()
            assert (segment == pad_id).all() and (flat_labels[begin:end] == IGNORE_INDEX).all()
            continue
        document, offsets = int(segment[0]) // 1000, (segment % 1000).tolist()
        assert (segment // 1000 == document).all() and offsets == list(range(offsets[0], offsets[0] + len(offsets)))
        seen.setdefault(document, []).extend(offsets)
        prompt = prompts[document] if prompts is not None else 0
        for offset, label in zip(offsets, flat_labels[begin:end].tolist()):
            following = offset + 1
            wanted = 1000 * document + following if prompt <= following < lengths[document] else IGNORE_INDEX
            assert label == wanted, f"document {document} offset {offset}"
    return seen


@pytest.mark.parametrize("strategy", ["greedy", "best_fit"])
@pytest.mark.parametrize("long_documents", ["split", "truncate"])
def test_every_document_token_in_one_row_with_labels_inside_its_document(strategy: str, long_documents: str) -> None:
    lengths = _lengths(300)
    assert max(lengths) > SEQ_LEN  # some documents are long
    ds = PackedTokens(_documents(lengths), SEQ_LEN, strategy=strategy, long_documents=long_documents, window=40)
    seen = _check(ds, lengths)
    for document, length in enumerate(lengths):
        kept = length if long_documents == "split" else min(length, SEQ_LEN)
        assert sorted(seen[document]) == list(range(kept)), f"document {document}"
    stats = ds.packing_stats()
    assert stats["truncated_tokens"] == sum(lengths) - sum(min(n, SEQ_LEN) if long_documents == "truncate" else n
                                                            for n in lengths)
    assert stats["fill"] == pytest.approx((sum(lengths) - stats["truncated_tokens"]) / (len(ds) * SEQ_LEN))
    if strategy == "best_fit":  # only long documents are cut, each into pieces of seq_len
        assert stats["split_documents"] == (sum(n > SEQ_LEN for n in lengths) if long_documents == "split" else 0)


def test_greedy_is_the_document_stream_cut_into_rows() -> None:
    lengths = _lengths(100, seed=1)
    ds = PackedTokens(_documents(lengths), SEQ_LEN)
    stream = np.concatenate(_documents(lengths))
    ids = _everything(ds)["input_ids"].reshape(-1)
    assert torch.equal(ids[: len(stream)], torch.from_numpy(stream)) and (ids[len(stream):] == 0).all()
    assert len(ds) == -(-len(stream) // SEQ_LEN)
    # a document cut at a row's end has its next token as the label of the row's last position
    labels = _everything(ds)["labels"]
    assert labels[0, -1] != IGNORE_INDEX or ids[SEQ_LEN - 1] // 1000 != ids[SEQ_LEN] // 1000


def test_best_fit_packs_fuller_than_greedy_without_cutting_and_within_its_window() -> None:
    lengths = _lengths(2000, seed=2, mean=2.0, high=SEQ_LEN)
    documents = _documents(lengths)
    best = PackedTokens(documents, SEQ_LEN, strategy="best_fit", window=500)
    assert best.packing_stats()["split_documents"] == 0
    assert best.packing_stats()["padding"] < 0.01
    small = PackedTokens(documents, SEQ_LEN, strategy="best_fit", window=10)
    assert small.packing_stats()["padding"] > best.packing_stats()["padding"]
    batch = _everything(small)
    for row, fill in zip(batch["input_ids"], small.plan.row_fill.tolist()):  # a row's documents: one window's
        assert len({int(t) // 1000 // 10 for t in row[:fill]}) == 1


def test_prompt_tokens_get_no_labels() -> None:
    lengths = [5, 40, 3, 12, 7]
    prompts = [2, 30, 3, 0, 6]
    ds = PackedTokens(_documents(lengths), 16, prompt_lengths=prompts, strategy="best_fit")
    _check(ds, lengths, prompts)
    labels = _everything(ds)["labels"]
    assert not any(0 <= int(t) < 2 for t in labels.reshape(-1))  # document 0's prompt (ids 0, 1) is never a target


def test_padding_takes_pad_id_and_no_label() -> None:
    ds = PackedTokens([[5, 6, 7], [8, 9]], 4, strategy="best_fit", pad_id=99)
    batch = _everything(ds)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 99], [8, 9, 99, 99]]
    assert batch["labels"].tolist() == [[6, 7, -100, -100], [9, -100, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 0, 1]]
    assert batch["cu_seqlens"].tolist() == [0, 3, 4, 6, 8] and batch["max_seqlen"] == 3


@pytest.mark.parametrize(("eot_at", "documents"), [
    ("start", [[7], [0, 1, 2], [0, 3], [9, 9], [0, 4]]),  # shards begin new documents too
    ("end", [[7, 0], [1, 2, 0], [3], [9, 9, 0], [4]]),
])
def test_token_shards_are_cut_at_the_end_of_text_id(tmp_path: Path, eot_at: str, documents: list[list[int]]) -> None:
    paths = [write_shard(tmp_path / "a.bin", [7, 0, 1, 2, 0, 3]), write_shard(tmp_path / "b.bin", [9, 9, 0, 4])]
    ds = PackedTokens(paths, 3, eot_id=0, eot_at=eot_at, strategy="best_fit", long_documents="split")
    assert ds.token_dtype == torch.uint16 and ds.num_documents == len(documents)
    batch = _everything(ds)
    got = [batch["input_ids"].reshape(-1)[b:e].tolist() for b, e in zip(batch["cu_seqlens"][:-1].tolist(),
                                                                        batch["cu_seqlens"][1:].tolist())]
    assert sorted(d for d in got if d not in ([0], [0, 0], [0, 0, 0])) == sorted(documents)
    from_glob = PackedTokens(str(tmp_path / "*.bin"), 3, eot_id=0, eot_at=eot_at, strategy="best_fit")
    assert torch.equal(_everything(from_glob)["input_ids"], batch["input_ids"])


def test_an_array_or_tensor_of_ids_and_a_list_of_documents_pack_alike() -> None:
    lengths = [4, 9, 1, 30, 6]
    stream = np.concatenate([np.concatenate([[50000], 1 + np.arange(n)]) for n in lengths]).astype(np.uint16)
    from_array = PackedTokens(stream, 8, eot_id=50000)
    from_tensor = PackedTokens(torch.from_numpy(stream.astype(np.int64)), 8, eot_id=50000)
    wide_ids = PackedTokens(stream.astype(np.uint32) + 70000, 8, eot_id=120000)  # uint32, ids over 65535
    documents = [np.concatenate([[50000], 1 + np.arange(n)]) for n in lengths]
    from_list = PackedTokens([torch.from_numpy(d) for d in documents], 8)
    for ds in (from_tensor, from_list):
        for key in ("input_ids", "labels", "position_ids", "cu_seqlens"):
            assert torch.equal(_everything(ds)[key], _everything(from_array)[key]), key
    wide, narrow = _everything(wide_ids), _everything(from_array)
    assert wide_ids.token_dtype == torch.uint32
    assert torch.equal(wide["input_ids"], torch.where(narrow["input_ids"] == 0, 0, narrow["input_ids"] + 70000))
    assert torch.equal(wide["labels"], torch.where(narrow["labels"] == -100, -100, narrow["labels"] + 70000))


def test_an_arrow_list_column_packs_as_the_list() -> None:
    pa = pytest.importorskip("pyarrow")
    documents = [list(range(1000 * d, 1000 * d + n)) for d, n in enumerate(_lengths(50, seed=3))]
    expected = _everything(PackedTokens(documents, SEQ_LEN, strategy="best_fit"))
    column = pa.array(documents, type=pa.list_(pa.int32()))
    chunked = pa.chunked_array([column.slice(0, 20), column.slice(20)])
    for source in (column, chunked):
        got = _everything(PackedTokens(source, SEQ_LEN, strategy="best_fit"))
        assert all(torch.equal(got[k], expected[k]) for k in ("input_ids", "labels", "cu_seqlens"))
    with pytest.raises(TokenFileError, match="1 null documents"):
        PackedTokens(pa.array([[1, 2], None], type=pa.list_(pa.int32())), 4)


def test_items_index_like_a_sequence_and_name_a_bad_index() -> None:
    ds = PackedTokens(_documents(_lengths(40)), SEQ_LEN)
    assert torch.equal(ds[-1]["input_ids"], ds[len(ds) - 1]["input_ids"])
    assert torch.equal(ds[torch.tensor(2)]["labels"], ds[2]["labels"])
    with pytest.raises(IndexError, match=f"row index {len(ds)} is out of range for {len(ds)} packed rows"):
        ds[len(ds)]
    assert gpuload.PackedTokens is PackedTokens and gpuload.datasets.PackedTokens is PackedTokens
    assert "PackedTokens(40 documents" in repr(ds)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"source": "ids", "seq_len": 8}, ValueError, "eot_id=None: token files and arrays are cut"),
    ({"source": "ids", "seq_len": 8, "eot_id": 0, "prompt_lengths": [1]}, ValueError, "prompt_lengths= masks"),
    ({"source": "docs", "seq_len": 0}, ValueError, r"seq_len=0 must be a positive int"),
    ({"source": "docs", "seq_len": 8, "strategy": "first_fit"}, ValueError, "choose one of greedy, best_fit"),
    ({"source": "docs", "seq_len": 8, "long_documents": "drop"}, ValueError, "choose one of split, truncate"),
    ({"source": "docs", "seq_len": 8, "window": 0}, ValueError, "window=0 must be a positive int"),
    ({"source": "docs", "seq_len": 8, "eot_at": "middle"}, ValueError, "eot_at='middle'"),
    ({"source": "docs", "seq_len": 8, "prompt_lengths": [1]}, ValueError, r"one int per document \(2\)"),
    ({"source": "docs", "seq_len": 8, "prompt_lengths": [1, 4]}, ValueError,
     r"prompt_lengths\[1\]=4 is not within document 1's 3 tokens"),
    ({"source": [], "seq_len": 8}, TokenFileError, "an empty list of documents"),
    ({"source": [[1, 2], [[3]]], "seq_len": 8}, TokenFileError, "document 1: a document is a 1-D sequence"),
    ({"source": [[1.5, 2]], "seq_len": 8}, TokenFileError, "document 0: .* float64"),
    ({"source": [[1, -2]], "seq_len": 8}, TokenFileError, "token id -2 is negative"),
    ({"source": [[], []], "seq_len": 8}, TokenFileError, "the documents hold no tokens"),
    ({"source": {"a": 1}, "seq_len": 8}, TypeError, "got dict"),
])
def test_bad_input_names_what_is_wrong(kwargs: dict[str, Any], error: type, match: str) -> None:
    source = {"ids": np.arange(10), "docs": [[1, 2], [3, 4, 5]]}.get(kwargs["source"], kwargs["source"]) \
        if not isinstance(kwargs["source"], (list, dict)) else kwargs["source"]
    with pytest.raises(error, match=match):
        PackedTokens(**{**kwargs, "source": source})


def test_empty_documents_are_left_out_and_counted() -> None:
    ds = PackedTokens([[1, 2], [], [3]], 4, strategy="best_fit")
    assert ds.packing_stats()["documents"] == 2 and ds.num_documents == 3
    assert _everything(ds)["input_ids"].tolist() == [[1, 2, 3, 0]]
