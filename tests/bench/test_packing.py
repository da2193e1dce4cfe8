"""The packing scenario: gpuload's packed rows against padding, a torchtune-style packed dataset
and transformers' DataCollatorWithFlattening, over one synthetic corpus (no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gpuload.bench.measure import order_differences, paired_overhead, time_pairs
from gpuload.bench.packing import (
    EOT,
    PackingConfig,
    PackingCost,
    _Tally,
    findings,
    format_packing,
    pad_to_longest,
    run_packing,
    synthetic_documents,
    torchtune_style_packs,
)
from gpuload.cli.main import main
from tests.bench.stage_panel import assert_traced

SMALL = PackingConfig(documents=300, median_tokens=60, max_tokens=600, seq_len=256, rows=4, steps=3, rounds=1,
                      window=300, pairs=6)


def test_the_corpus_is_log_normal_documents_each_begun_by_the_end_of_text_id() -> None:
    documents = synthetic_documents(PackingConfig(documents=4000))
    lengths = np.array([len(d) for d in documents])
    assert len(documents) == 4000 and all(d[0] == EOT and (d[1:] < EOT).all() for d in documents)
    assert 2 <= lengths.min() and lengths.max() <= 16_384
    assert 360 < np.median(lengths) < 440 and 600 < lengths.mean() < 720  # median 400, sigma 1: mean 400 e^0.5


def test_torchtune_style_packs_hold_every_document_whole_in_order() -> None:
    documents = synthetic_documents(SMALL)
    packs = torchtune_style_packs(documents, SMALL.seq_len)
    found = []
    for pack in packs:
        assert pack["tokens"].shape == (SMALL.seq_len,) and int(pack["seq_lens"].sum()) == SMALL.seq_len
        segments = torch.split(pack["tokens"], pack["seq_lens"].tolist())
        labels = torch.split(pack["labels"], pack["seq_lens"].tolist())
        positions = torch.split(pack["input_pos"], pack["seq_lens"].tolist())
        whole = [s[0] == EOT for s in segments]  # every document begins with EOT; padding with 0
        assert whole == sorted(whole, reverse=True) and sum(whole) >= len(whole) - 1  # padding last, once
        for segment, label, position, is_document in zip(segments, labels, positions, whole):
            assert position.tolist() == list(range(len(segment)))
            if is_document:
                found.append(segment)
                assert torch.equal(label[:-1], segment[1:]) and label[-1] == -100
            else:
                assert (segment == 0).all() and (label == -100).all()
    assert len(found) == len(documents)
    assert all(torch.equal(f, torch.from_numpy(d[: SMALL.seq_len])) for f, d in zip(found, documents))


def test_pad_to_longest_counts_its_padding() -> None:
    tally = _Tally()
    batch = pad_to_longest(tally)([torch.tensor([5, 6, 7]), torch.tensor([8])])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[6, 7, -100], [-100, -100, -100]]
    assert tally.documents == 4 and tally.total == 6 and tally.padding == pytest.approx(1 / 3)


def test_a_small_run_measures_every_loader() -> None:
    rows, cost = run_packing(SMALL, torch.device("cpu"))
    names = [row.name for row in rows]
    assert names == ["gpuload PackedTokens (greedy)", "gpuload PackedTokens (best_fit)",
                     "gpuload TokenWindows (no documents)", "torch DataLoader, pad to longest",
                     "torchtune-style PackedDataset (ahead)", "transformers DataCollatorWithFlattening"]
    by_name = {row.name: row for row in rows}
    assert all(len(row.seconds) == 1 and row.tokens_per_s(SMALL) > 0 for row in rows)
    assert by_name["gpuload PackedTokens (greedy)"].padding < 0.01
    assert by_name["transformers DataCollatorWithFlattening"].padding == 0
    assert by_name["torch DataLoader, pad to longest"].padding > by_name["gpuload PackedTokens (best_fit)"].padding
    for row in rows:  # the stage panel's data: each gpuload loader's traced steps, no other loader's
        if row.name.startswith("gpuload"):
            assert row.stages is not None
            assert_traced(row.stages, row.name)
        else:
            assert row.stages is None
    assert cost.pairs == SMALL.pairs and len(cost.windows_s) == SMALL.pairs
    assert all(seconds > 0 for seconds in cost.packed_s + cost.windows_s)
    found = findings(rows, SMALL, cost)
    assert found["packed_step_over_windows_step"] == paired_overhead(cost.packed_s, cost.windows_s)
    assert set(found) == {"padding_greedy", "padding_best_fit", "packed_step_over_windows_step",
                          "vs_collator_tokens_per_s", "vs_pad_to_longest_tokens_per_s"}
    table = format_packing(rows, SMALL)
    assert all(len(line) <= 100 for line in table.splitlines()) and "doc tokens/s" in table


def test_pairs_alternate_which_call_leads() -> None:
    calls: list[str] = []
    first, second = time_pairs(lambda: calls.append("a"), lambda: calls.append("b"), 4, torch.device("cpu"))
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"] and len(first) == len(second) == 4


def test_pairs_read_the_given_clock_and_prepare_each_call_untimed() -> None:
    ticks = iter(range(100))
    prepared: list[bool] = []

    def prepare(is_first: bool) -> None:
        prepared.append(is_first)
        next(ticks)  # a tick of the preparation would show in the times if it were timed

    first, second = time_pairs(lambda: next(ticks), lambda: None, 2, torch.device("cpu"),
                               clock=lambda: float(next(ticks)), prepare=prepare)
    assert prepared == [True, False, False, True]
    assert first == [2.0, 2.0] and second == [1.0, 1.0]  # the clock's ticks: first's call took one more


def test_the_order_differences_are_the_median_of_the_pairs_each_side_led() -> None:
    new = [12.0, 10.0, 14.0, 10.0, 12.0, 11.0]
    base = [9.0, 11.0, 9.0, 11.0, 9.0, 11.0]
    assert order_differences(new, base) == (3.0, -1.0)
    with pytest.raises(ValueError, match="at least 2 pairs"):
        order_differences([1.0], [1.0])


def test_the_paired_overhead_averages_the_median_difference_of_each_order() -> None:
    # the step run second is 1 faster for the order alone: packed leads in the even pairs
    packed = [12.0, 10.0, 12.0, 10.0, 12.0, 10.0]
    windows = [9.0, 11.0, 9.0, 11.0, 9.0, 11.0]
    assert paired_overhead(packed, windows) == pytest.approx(1 / 10)  # (3 + -1) / 2 over the median, 10
    assert paired_overhead(windows, windows) == 0
    with pytest.raises(ValueError, match="at least 2 pairs"):
        paired_overhead([1.0], [1.0])


def test_the_packing_cost_line_reads_the_measured_pairs() -> None:
    cost = PackingCost(packed_s=[0.0012, 0.0010, 0.0012, 0.0010], windows_s=[0.0009, 0.0011, 0.0009, 0.0011])
    assert cost.line() == "packing cost: +10.0% of a windows step (median of 4 pairs)"
    assert cost.as_dict()["overhead"] == pytest.approx(0.1) and cost.as_dict()["pairs"] == 4


@pytest.mark.slow
def test_the_command_writes_its_findings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--scenario", "packing", "--quick", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["scenario"] == "packing" and document["load_average_after"]
    paired = document["packing_cost"]
    assert paired["pairs"] == PackingConfig.quick().pairs == len(paired["packed_s"]) == len(paired["windows_s"])
    assert document["findings"]["packed_step_over_windows_step"] == paired["overhead"] == pytest.approx(
        paired_overhead(paired["packed_s"], paired["windows_s"]))
    assert f"packing cost: {paired['overhead']:+.1%} of a windows step (median of {paired['pairs']} pairs)" in printed
    assert document["findings"]["padding_greedy"] < 0.01 and document["findings"]["padding_best_fit"] < 0.002
    assert len(document["results"]) == 6
    assert [row["name"] for row in document["stages"]] == [
        "gpuload PackedTokens (greedy)", "gpuload PackedTokens (best_fit)", "gpuload TokenWindows (no documents)"]
    assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG")

