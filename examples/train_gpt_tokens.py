"""Train a tiny GPT on a token shard with gpuload, stop mid-epoch, resume with the same losses.

Run: python examples/train_gpt_tokens.py   (the GPU when there is one, else the CPU; about 36 s
on 2 idle cores)

1. Text: a generated, public-domain corpus of English arithmetic sentences ("seven plus three
   is ten."), so nothing is downloaded; byte-level tokens, written as an llm.c / nanoGPT
   speedrun shard (256 int32 header, uint16 ids).
2. Data: ``gpuload.TokenWindows(shard, seq_len)`` under ``gpuload.DataLoader``: the token
   buffer is cached (on the GPU when there is one) and each batch is one gather of windows.
3. Training: a small causal transformer for a few hundred steps. One run goes straight
   through; another stops mid-epoch (a preemption), saves model, optimizer and
   ``loader.state_dict()`` with ``torch.save``; a third, built anew, loads the checkpoint and
   finishes. Its losses equal the straight run's, step for step.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

import gpuload
from gpuload.datasets.tokens import write_shard

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
         "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen"]


def generated_text(sentences: int, seed: int = 0) -> str:
    """Sentences of true sums and differences of small numbers, in words."""
    rng = random.Random(seed)
    lines = []
    for _ in range(sentences):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        if rng.random() < 0.5:
            lines.append(f"{WORDS[a]} plus {WORDS[b]} is {WORDS[a + b]}.")
        else:
            a, b = max(a, b), min(a, b)
            lines.append(f"{WORDS[a]} minus {WORDS[b]} is {WORDS[a - b]}.")
    return "\n".join(lines) + "\n"


def tokenize_to_shard(text: str, folder: Path) -> Path:
    """Byte-level tokens (ids 0-255) written as a uint16 speedrun shard."""
    ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    return write_shard(folder / "arithmetic_000000.bin", ids)


class TinyGPT(nn.Module):
    """Token + position embeddings, pre-norm causal transformer blocks, a tied output head."""

    def __init__(self, vocab: int = 256, seq_len: int = 64, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(seq_len, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        for embedding in (self.tokens, self.positions):
            nn.init.normal_(embedding.weight, std=0.02)  # small logits at the start (GPT-2's init)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        h = self.tokens(x) + self.positions(torch.arange(length, device=x.device))
        h = self.blocks(h, mask=self.mask[:length, :length], is_causal=True)
        return self.norm(h) @ self.tokens.weight.T


def build(shard: Path, args: argparse.Namespace) -> tuple[gpuload.DataLoader, nn.Module, torch.optim.Optimizer]:
    """The same loader, model and optimizer each time (fixed seeds): what a restarted job builds."""
    windows = gpuload.TokenWindows(shard, args.seq_len)
    loader = gpuload.DataLoader(windows, batch_size=args.batch_size, shuffle=True,
                                generator=torch.Generator().manual_seed(42))
    torch.manual_seed(0)
    model = TinyGPT(seq_len=args.seq_len).to(loader.device)
    return loader, model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def next_token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of the model's next-token logits on a batch of windows ``(x, y)``."""
    x, y = batch
    logits = model(x)
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def train(
    loader, model, optimizer, steps: int, done: int = 0, stop_at: int | None = None, loss_of=next_token_loss
) -> tuple[list[float], bytes | None]:
    """Train from step ``done`` to ``steps`` (``loss_of(model, batch)``: a batch's loss); with
    ``stop_at``, stop after that step and return a checkpoint. Returns the losses of the steps run."""
    losses: list[float] = []
    step = done
    while step < steps:
        for batch in loader:  # a resumed loader starts with the rest of the interrupted epoch
            loss = loss_of(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            step += 1
            if step % 100 == 0:
                print(f"step {step}: loss {losses[-1]:.3f}")
            if step == stop_at:
                checkpoint = io.BytesIO()
                torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "loader": loader.state_dict()}, checkpoint)
                return losses, checkpoint.getvalue()
            if step == steps:
                break
    return losses, None


def stopped_and_resumed(build, steps: int, stop_at: int, per_epoch: int, loss_of=next_token_loss) -> list[float]:
    """A run stopped after step ``stop_at`` (a preemption) and one built anew by ``build()`` (as a new
    process would) that loads its checkpoint and finishes: the losses of both, in order."""
    loader, model, optimizer = build()
    before, checkpoint = train(loader, model, optimizer, steps, stop_at=stop_at, loss_of=loss_of)
    loader.close()
    print(f"stopped after step {stop_at} (epoch {stop_at // per_epoch}, batch {stop_at % per_epoch}), "
          f"checkpoint {len(checkpoint) // 1024} KiB")

    loader, model, optimizer = build()
    saved = torch.load(io.BytesIO(checkpoint), weights_only=True)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    loader.load_state_dict(saved["loader"])
    after, _ = train(loader, model, optimizer, steps, done=saved["step"], loss_of=loss_of)
    print(f"resumed at step {saved['step']}: losses {after[0]:.3f} -> {after[-1]:.3f}")
    return before + after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--stop-at", type=int, default=None, help="the step to stop after (default: mid-epoch)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--sentences", type=int, default=6000)
    args = parser.parse_args()
    if (os.cpu_count() or 1) <= 2:
        torch.set_num_threads(1)  # a tiny model on 2 cores: a second intra-op thread only waits (10x slower)

    with tempfile.TemporaryDirectory(prefix="gpt-tokens-") as folder:
        shard = tokenize_to_shard(generated_text(args.sentences), Path(folder))
        loader, model, optimizer = build(shard, args)
        per_epoch = len(loader)
        stop_at = args.stop_at or min(args.steps - 1, per_epoch + per_epoch // 2)  # in the middle of epoch 1
        print(f"{loader.dataset}; {per_epoch} batches per epoch, on {loader.device} ({loader.stats.path or 'placing'})")

        straight, _ = train(loader, model, optimizer, args.steps)
        print(f"straight run: {args.steps} steps, loss {straight[0]:.3f} -> {straight[-1]:.3f}, "
              f"served by {loader.stats.path}, {loader.stats.extra['tokens']['token_bytes']} token bytes cached")

        same = stopped_and_resumed(lambda: build(shard, args), args.steps, stop_at, per_epoch) == straight
        print(f"resumed with the same losses: {same}")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
