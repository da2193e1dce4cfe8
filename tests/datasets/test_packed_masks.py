"""Document masks of packed batches: the FlexAttention mask_mod, the SDPA mask and the segment
ids agree with each other and with a plain reference, and attention never crosses documents."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention
from torch.nn.functional import scaled_dot_product_attention

from gpuload.datasets.packed_masks import (
    document_causal_mask,
    document_causal_mask_mod,
    document_ids,
    document_ids_from_cu_seqlens,
)
from gpuload.datasets.packing import PackedTokens, collate_packed

SEQ_LEN = 32


def _batch(seed: int = 0, documents: int = 30) -> dict:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, 500, size=n) for n in rng.integers(1, 40, size=documents)]
    ds = PackedTokens(docs, SEQ_LEN, strategy="best_fit", pad_id=0)
    return collate_packed([ds[i] for i in range(len(ds))])


def _reference_mask(cu_seqlens: torch.Tensor, rows: int) -> torch.Tensor:
    """Token i of the flattened batch sees token j when one segment holds both and j <= i."""
    total = rows * SEQ_LEN
    allowed = torch.zeros(total, total, dtype=torch.bool)
    for begin, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        allowed[begin:end, begin:end] = torch.ones(end - begin, end - begin, dtype=torch.bool).tril()
    blocks = [allowed[r * SEQ_LEN:(r + 1) * SEQ_LEN, r * SEQ_LEN:(r + 1) * SEQ_LEN] for r in range(rows)]
    return torch.stack(blocks)[:, None]


def test_segment_ids_from_positions_and_from_cu_seqlens_agree() -> None:
    batch = _batch()
    rows = batch["input_ids"].shape[0]
    ids = document_ids(batch["position_ids"])
    assert ids.dtype == torch.int32 and ids.shape == batch["position_ids"].shape
    assert torch.equal(ids, document_ids_from_cu_seqlens(batch["cu_seqlens"], rows, SEQ_LEN))
    assert int(ids.max()) + 1 == len(batch["cu_seqlens"]) - 1


def test_the_sdpa_mask_and_the_mask_mod_are_the_block_diagonal_causal_mask() -> None:
    batch = _batch(1)
    rows = batch["input_ids"].shape[0]
    expected = _reference_mask(batch["cu_seqlens"], rows)
    assert torch.equal(document_causal_mask(batch["position_ids"]), expected)
    mask_mod = document_causal_mask_mod(document_ids(batch["position_ids"]))
    assert torch.equal(create_mask(mask_mod, rows, None, SEQ_LEN, SEQ_LEN, device="cpu"), expected)


def test_flex_attention_with_the_block_mask_equals_sdpa_with_the_mask() -> None:
    batch = _batch(2, documents=8)
    rows = batch["input_ids"].shape[0]
    q, k, v = torch.randn(3, rows, 2, SEQ_LEN, 16, generator=torch.Generator().manual_seed(0)).unbind(0)
    block_mask = create_block_mask(document_causal_mask_mod(document_ids(batch["position_ids"])),
                                   rows, None, SEQ_LEN, SEQ_LEN, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention not compiled: the eager reference, slow but exact
        flex = flex_attention(q, k, v, block_mask=block_mask)
    sdpa = scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(batch["position_ids"]))
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", ["sdpa", "flex", "causal only"])
def test_a_tokens_attention_output_ignores_the_other_documents_of_its_row(how: str) -> None:
    batch = _batch(3)
    ids, positions = batch["input_ids"], batch["position_ids"]
    documents = document_ids(positions)
    row = int(torch.nonzero((documents != documents[:, :1]).any(1))[0])  # a row with several segments
    last = documents[row] == documents[row, -1]  # its last segment: earlier documents stand before it
    changed = ids.clone()
    changed[row, ~last] = (changed[row, ~last] * 7 + 3) % 500  # every other document of the row
    embed = torch.nn.Embedding(500, 3 * 2 * 8)
    torch.nn.init.normal_(embed.weight, generator=torch.Generator().manual_seed(1))

    def attend(tokens: torch.Tensor) -> torch.Tensor:
        q, k, v = embed(tokens).view(*tokens.shape, 3, 2, 8).permute(2, 0, 3, 1, 4)
        if how == "sdpa":
            return scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(positions))
        if how == "causal only":
            return scaled_dot_product_attention(q, k, v, is_causal=True)
        block_mask = create_block_mask(document_causal_mask_mod(documents), tokens.shape[0], None, SEQ_LEN,
                                       SEQ_LEN, device="cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return flex_attention(q, k, v, block_mask=block_mask)

    with torch.no_grad():
        before, after = attend(ids), attend(changed)
    assert not torch.equal(before[row, :, ~last], after[row, :, ~last])  # the change did reach the others
    # with the document mask the last segment does not see it; with a causal mask alone it would
    assert torch.equal(before[row, :, last], after[row, :, last]) == (how != "causal only")
