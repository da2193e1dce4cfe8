"""What every bench scenario's stage panel needs: a traced row per gpuload loader, and its bars."""

from __future__ import annotations

from typing import Any

from gpuload.verdict import STAGES


def assert_traced(row: dict[str, Any], name: str) -> None:
    """``row`` is the stage panel's row of the gpuload loader ``name``: its wait per step, and
    each stage's ms per step from its traced epoch (a named stage took time)."""
    assert row["name"] == name and row["kind"] == "gpuload"
    assert row["wait_ms_per_step"] is not None and row["wait_ms_per_step"] >= 0
    stage_ms = row["stage_ms_per_step"]
    assert stage_ms and set(stage_ms) <= set(STAGES), stage_ms
    assert all(ms >= 0 for ms in stage_ms.values()) and sum(stage_ms.values()) > 0


def stage_bars(figure: Any) -> set[str]:
    """The loader names the figure draws stage bars for (``gid`` "stage:STAGE:NAME")."""
    return {patch.get_gid().split(":", 2)[2] for axis in figure.axes for patch in axis.patches
            if (patch.get_gid() or "").startswith("stage:")}
