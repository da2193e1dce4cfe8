"""The gpuload command runs end to end on the CPU, and CI runs the README's test command."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

from gpuload.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_bench_quick_prints_table_and_writes_json_and_chart(tmp_path: Path, capsys) -> None:
    args = ["bench", "--quick", "--samples", "2048", "--epochs", "1", "--device", "cpu", "--out", str(tmp_path)]
    assert main([*args, "--step", "sleep", "--step-ms", "1"]) == 0
    printed = capsys.readouterr().out
    assert "torch (num_workers=0)" in printed and "of ideal" in printed
    # torch with 2 workers may beat 0 workers on a busy machine; the headline then names both ratios
    assert re.search(r"[\d.]+x torch's DataLoader \(num_workers=0\)(, [\d.]+x with num_workers=2)? on this machine",
                     printed)
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    document = json.loads((tmp_path / "bench.json").read_text())
    names = [r["name"] for r in document["results"]]
    assert names[0].startswith("torch DataLoader") and any(name.startswith("ideal") for name in names)
    assert any(name.startswith("gpuload DataLoader") for name in names)
    assert all(r["samples_per_s"] > 0 for r in document["results"])
    assert document["config"]["num_samples"] == 2048 and document["environment"]["device"] == "cpu"
    for r in document["results"]:
        assert r["batches_per_epoch"] == 4 and 0 <= r["wait_share"] <= 1
        assert r["h2d_bytes_per_epoch"] == 0  # nothing crosses PCIe on the CPU


def test_bench_on_user_npz(tmp_path: Path, capsys) -> None:
    import numpy as np

    path = tmp_path / "data.npz"
    np.savez(path, x=np.zeros((300, 8), dtype=np.float32), y=np.arange(300))
    assert main(["bench", "--data", str(path), "--epochs", "1", "--batch-size", "64", "--torch-workers", "0",
                 "--device", "cpu", "--out", str(tmp_path)]) == 0
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["scenario"].startswith("inmemory:") and document["results"][0]["batches_per_epoch"] == 5


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.+?)\n```", readme)
    assert len(commands) >= 2
    ci_script = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci_script.splitlines()


def test_bench_images_scenario_on_generated_photos(tmp_path: Path, capsys, monkeypatch) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    args = ["bench", "--scenario", "images", "--samples", "12", "--batch-size", "6", "--epochs", "1",
            "--image-size", "32", "--torch-workers", "0", "--device", "cpu", "--out", str(tmp_path / "out")]
    assert main(args) == 0
    assert list(scratch.iterdir()) == []  # the generated photographs were in a temporary folder, removed
    document = json.loads((tmp_path / "out" / "bench.json").read_text())
    names = [r["name"] for r in document["results"]]
    assert names == [
        "torch DataLoader + PIL (num_workers=0)",
        "gpuload DataLoader (decode + transforms)",
        "gpuload DataLoader (decoded image cache)",
    ]
    gpuload_row, cached_row = document["results"][1:]
    assert gpuload_row["batches_per_epoch"] == 2 and gpuload_row["decode_backend"] in ("dali-cpu", "torchvision", "pil")
    assert gpuload_row["of_ideal"] is None and "image_cache" not in gpuload_row
    assert cached_row["image_cache"] == "decoded" and cached_row["cached_images"] == 12
    torch_bytes = 12 * 3 * 32 * 32 * 2 + 12 * 8  # float16 crops and int64 labels, copied every epoch
    assert document["results"][0]["h2d_modelled"]["per_epoch"] == torch_bytes
    files = gpuload_row["h2d_modelled"]["per_epoch"]
    assert files > 0 and cached_row["h2d_modelled"] == {**cached_row["h2d_modelled"], "first_epoch": files,
                                                        "per_epoch": 0}


def test_plan_names_bombs_and_unreadable_files_instead_of_crashing(tmp_path: Path, capsys) -> None:
    import image_fixtures as F

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "bomb.jpg").write_bytes(F.bomb_jpeg())
    (tmp_path / "a" / "junk.png").write_bytes(b"not a png")
    (tmp_path / "a" / "ok.jpg").write_bytes(F.jpeg("grayscale"))
    assert main(["plan", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "3 images; 1 probed" in out
    assert re.search(r"bad files: 2 of the 3 probed .*bomb.jpg: the header says 20000x20000 = 400,000,000 pixels, over the limit", out)
    assert "junk.png: not a readable image header" in out
    (tmp_path / "a" / "ok.jpg").unlink()
    (tmp_path / "a" / "junk.png").unlink()
    assert main(["plan", str(tmp_path)]) == 2
    assert "none of the 1 probed images can be loaded" in capsys.readouterr().err
