"""gpuload.exit_threads: background threads stopped before the interpreter shuts down."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from child_processes import child_environment

from gpuload.exit_threads import running, start_stoppable, stop_and_wait

HANG_S = 300


def _waiting_thread(release: threading.Event, join_timeout: float, stop=None) -> threading.Thread:
    """A listed thread that runs until ``release`` is set; ``stop`` defaults to setting it."""
    return start_stoppable(release.wait, (60,), "test-waiting", stop or release.set, join_timeout)


def test_a_thread_is_listed_while_it_runs_then_stopped_and_waited_for():
    release = threading.Event()
    thread = _waiting_thread(release, join_timeout=30)
    assert thread in running() and thread.daemon and thread.name == "test-waiting"
    stop_and_wait([thread])
    assert not thread.is_alive()
    assert thread not in running()


def test_a_thread_that_returned_is_no_longer_listed():
    release = threading.Event()
    release.set()
    thread = _waiting_thread(release, join_timeout=30)
    thread.join(30)
    assert thread not in running()


def test_a_thread_that_does_not_stop_in_time_is_named_and_the_others_still_stop(capsys):
    stuck_release, failing_release, other_release = threading.Event(), threading.Event(), threading.Event()

    def failing_stop() -> None:
        raise RuntimeError("this stop fails")

    stuck = _waiting_thread(stuck_release, join_timeout=0.05, stop=lambda: None)
    failing = _waiting_thread(failing_release, join_timeout=0.05, stop=failing_stop)
    other = _waiting_thread(other_release, join_timeout=30)
    try:
        stop_and_wait([failing, stuck, other])
        assert not other.is_alive()
        assert stuck.is_alive() and failing.is_alive()
        err = capsys.readouterr().err
        assert "gpuload: at exit, test-waiting (waited 0.05 s), test-waiting (waited 0.05 s) did not stop" in err
        assert "close() the loader" in err
    finally:
        stuck_release.set()
        failing_release.set()
        stuck.join(30)
        failing.join(30)


SCRIPT = """
import torch
from torch.utils.data import TensorDataset

import gpuload

data = TensorDataset(torch.randn(4096, 3, 64, 64), torch.arange(4096))
loader = gpuload.DataLoader(data, batch_size=512, shuffle=True, cache=False)
batches = iter(loader)
images, labels = next(batches)
print("first batch", tuple(images.shape), flush=True)
# ends here: the prefetch thread is making the next batches inside torch
"""


def test_a_script_that_ends_mid_epoch_without_close_exits_cleanly(tmp_path: Path):
    """Before: SIGABRT ("terminate called without an active exception", status 134) in 10 of 10
    runs, the daemon prefetch thread coming back from torch while the interpreter finalized."""
    script = tmp_path / "ends_mid_epoch.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], env=child_environment(), capture_output=True, text=True,
                          timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "first batch (512, 3, 64, 64)" in done.stdout
    assert "terminate called" not in done.stderr
    assert "did not stop" not in done.stderr
