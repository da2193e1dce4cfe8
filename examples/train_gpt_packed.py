"""Train a tiny GPT on packed documents with document masking, stop mid-epoch, resume with the same losses.

Run: python examples/train_gpt_packed.py   (the GPU when there is one, else the CPU; about 18 s
on 2 idle cores)

1. Text: documents of a few generated arithmetic sentences each (as in
   ``train_gpt_tokens.py``), byte-level tokens, each document begun by an end-of-text id (256),
   written as one llm.c / nanoGPT speedrun shard.
2. Data: ``gpuload.PackedTokens(shard, seq_len, eot_id=256, strategy="best_fit")`` under
   ``gpuload.DataLoader(..., collate_fn=packed.collate)``: documents packed into rows with almost
   no padding; each batch brings ``position_ids`` that restart at each document and labels that
   never cross one.
3. Model: the tiny transformer of ``train_gpt_tokens.py``, its positions from ``position_ids``
   and its attention held inside each document by the batch's block-diagonal causal mask
   (``gpuload.datasets.packed_masks.document_causal_mask``). It checks that a token's logits do
   not change when another document of its row changes.
4. Training: one run straight through; one stopped mid-epoch (a preemption) that saves model,
   optimizer and ``loader.state_dict()``; a third built anew that loads it and finishes. Its
   losses equal the straight run's, step for step.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from train_gpt_tokens import TinyGPT, generated_text, stopped_and_resumed, train

import gpuload
from gpuload.datasets.packed_masks import document_causal_mask
from gpuload.datasets.tokens import write_shard

EOT = 256  # the end-of-text id, after the 256 byte ids


def documents_to_shard(documents: int, folder: Path, seed: int = 0) -> Path:
    """``documents`` documents of 1-8 sentences, byte tokens, each begun by EOT, as a uint16 shard."""
    rng = random.Random(seed)
    ids = []
    for number in range(documents):
        text = generated_text(rng.randint(1, 8), seed=seed * 100_000 + number)
        ids.append(np.concatenate([[EOT], np.frombuffer(text.encode("utf-8"), dtype=np.uint8)]))
    return write_shard(folder / "documents_000000.bin", np.concatenate(ids).astype(np.uint16))


class PackedGPT(TinyGPT):
    """TinyGPT reading packed rows: positions restart at each document, attention stays inside it."""

    def __init__(self, seq_len: int, heads: int = 4) -> None:
        super().__init__(vocab=EOT + 1, seq_len=seq_len, heads=heads)
        self.heads = heads

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:  # one document per row
            position_ids = torch.arange(x.shape[1], device=x.device).expand_as(x)
        h = self.tokens(x) + self.positions(position_ids)
        blocked = ~document_causal_mask(position_ids)  # nn.Transformer masks where True
        h = self.blocks(h, mask=blocked.repeat_interleave(self.heads, dim=0).squeeze(1))
        return self.norm(h) @ self.tokens.weight.T


def build(shard: Path, args: argparse.Namespace) -> tuple[gpuload.DataLoader, PackedGPT, torch.optim.Optimizer]:
    """The same loader, model and optimizer each time (fixed seeds): what a restarted job builds."""
    packed = gpuload.PackedTokens(shard, args.seq_len, eot_id=EOT, strategy="best_fit")
    loader = gpuload.DataLoader(packed, batch_size=args.batch_size, shuffle=True, collate_fn=packed.collate,
                                generator=torch.Generator().manual_seed(42))
    torch.manual_seed(0)
    model = PackedGPT(args.seq_len).to(loader.device)
    return loader, model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def packed_loss(model: PackedGPT, batch: dict[str, Any]) -> torch.Tensor:
    """Cross-entropy of the next-token logits where a label is (not across documents, not padding)."""
    logits = model(batch["input_ids"], batch["position_ids"])
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def logits_ignore_other_documents(model: PackedGPT, batch: dict[str, Any]) -> bool:
    """Whether the logits of a row's last document stay the same when the row's other documents change."""
    ids, positions = batch["input_ids"], batch["position_ids"]
    starts = (positions == 0).int().cumsum(1)
    row = int(torch.nonzero(starts[:, -1] > 1)[0])  # a row holding several segments
    last = starts[row] == starts[row, -1]
    changed = ids.clone()
    changed[row, ~last] = (changed[row, ~last] + 1) % EOT
    with torch.no_grad():
        before, after = model(ids, positions)[row, last], model(changed, positions)[row, last]
    return torch.equal(before, after)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--stop-at", type=int, default=None, help="the step to stop after (default: mid-epoch)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--documents", type=int, default=600)
    args = parser.parse_args()
    if (os.cpu_count() or 1) <= 2:
        torch.set_num_threads(1)  # a tiny model on 2 cores: a second intra-op thread only waits

    with tempfile.TemporaryDirectory(prefix="gpt-packed-") as folder:
        shard = documents_to_shard(args.documents, Path(folder))
        loader, model, optimizer = build(shard, args)
        per_epoch = len(loader)
        stop_at = args.stop_at or min(args.steps - 1, per_epoch + per_epoch // 2)  # in the middle of epoch 1
        packing = loader.dataset.packing_stats()
        print(f"{loader.dataset}; padding {packing['padding']:.2%}; {per_epoch} batches per epoch, on {loader.device}")

        straight, _ = train(loader, model, optimizer, args.steps, loss_of=packed_loss)
        print(f"straight run: {args.steps} steps, loss {straight[0]:.3f} -> {straight[-1]:.3f}, "
              f"served by {loader.stats.path}")
        apart = logits_ignore_other_documents(model.eval(), next(iter(loader)))
        print(f"a document's logits ignore the other documents of its row: {apart}")

        resumed = stopped_and_resumed(lambda: build(shard, args), args.steps, stop_at, per_epoch, loss_of=packed_loss)
        same = resumed == straight
        print(f"resumed with the same losses: {same}")
        if not (same and apart):
            raise SystemExit(1)


if __name__ == "__main__":
    main()
