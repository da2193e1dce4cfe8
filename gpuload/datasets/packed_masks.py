"""Attention that stays inside each document of a packed batch (:class:`~gpuload.PackedTokens`).

A packed row holds several documents; causal attention over the whole row would let a token see
the documents before it. Three ways to keep them apart, all built from the batch on its device
without a host sync:

- ``flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True)``
  on the flattened batch takes the batch's ``cu_seqlens`` and ``max_seqlen`` as they are;
- FlexAttention: :func:`document_causal_mask_mod` for ``create_block_mask``;
- ``scaled_dot_product_attention``: :func:`document_causal_mask`, a boolean
  ``(rows, 1, seq_len, seq_len)`` block-diagonal causal mask (``seq_len``\\ :sup:`2` bytes a
  row: for short rows, or as the reference the others are checked against).

Padding at a row's end is a segment of its own: it attends to itself only (no empty softmax row).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["document_causal_mask", "document_causal_mask_mod", "document_ids", "document_ids_from_cu_seqlens"]


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Which segment each token belongs to, ``(rows, seq_len)`` int32 numbered over the batch,
    from ``position_ids`` (a segment starts where they are 0)."""
    starts = (position_ids == 0).reshape(-1).to(torch.int32)
    return (torch.cumsum(starts, 0, dtype=torch.int32) - 1).view(position_ids.shape)


def document_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, rows: int, seq_len: int) -> torch.Tensor:
    """:func:`document_ids` from a batch's ``cu_seqlens`` (the segment edges of the flattened batch)."""
    tokens = torch.arange(rows * seq_len, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return (torch.searchsorted(cu_seqlens, tokens, right=True) - 1).to(torch.int32).view(rows, seq_len)


MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def document_causal_mask_mod(documents: torch.Tensor) -> MaskMod:
    """A FlexAttention ``mask_mod``: query ``q`` of row ``b`` sees key ``k`` when both are in the
    same segment and ``k <= q``. ``documents``: :func:`document_ids` of the batch. Use it as
    ``create_block_mask(mask_mod, rows, None, seq_len, seq_len, device=...)``."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (documents[b, q] == documents[b, k]) & (q >= k)

    return mask_mod


def document_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """A boolean ``attn_mask`` for ``scaled_dot_product_attention``, ``(rows, 1, seq_len, seq_len)``:
    True where a query may attend (same segment, not ahead)."""
    documents = document_ids(position_ids)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril_()
    return ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]
