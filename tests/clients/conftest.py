"""What several client tests share: one torchrun job for every Lightning ``ddp`` fit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# What torchrun sets for its ranks; a stale value from the calling process must not reach it.
TORCHRUN_ENV = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
                "GROUP_RANK"}
#: lightning_job.py's kinds (``lightning_job.KINDS``) and lightning_scope_job.py's fit (``scope``).
LIGHTNING_DDP_FITS = ("arrays", "generic", "scope")


@pytest.fixture(scope="session")
def lightning_ddp_fits(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``torchrun --standalone --nproc_per_node 2 lightning_job.py OUT arrays generic scope``: each
    fit in turn into OUT/KIND, so the ranks start and import torch and Lightning once for
    test_lightning.py and test_lightning_scope.py together."""
    pytest.importorskip("pytorch_lightning", reason="PyTorch Lightning is a test dependency: pip install -e '.[test]'")
    out = tmp_path_factory.mktemp("lightning_ddp")
    env = {name: value for name, value in os.environ.items() if name not in TORCHRUN_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env["PYTHONFAULTHANDLER"] = "1"  # a rank that aborts prints its Python threads' stacks
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(HERE / "lightning_job.py"), str(out), *LIGHTNING_DDP_FITS]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900), out
