"""DALI's native [ERROR] lines are kept off the console; everything else on fd 2 still gets there."""

from __future__ import annotations

import logging
import os
import threading

import image_fixtures as F
import pytest

from gpuload.decode import BatchDecoder
from gpuload.decode._dali import dali_installed
from gpuload.decode._stderr import quiet_native_stderr, take_native_lines

NATIVE = b"\x1b[0;31m[ERROR] \x1b[0m[libjpeg_turbo_decoder] Could not decode jpeg code stream\n"


def test_native_lines_are_kept_and_the_rest_passes_through(capfd: pytest.CaptureFixture[str]) -> None:
    take_native_lines()
    with quiet_native_stderr():
        os.write(2, b"a traceback line\n" + NATIVE + b"[WARNING] [nvjpeg] plain, no colours\n[not a log line\n")
        os.write(2, b"\r 50%|#####     | progress")  # no newline: passed on all the same
    assert take_native_lines() == [
        "[ERROR] [libjpeg_turbo_decoder] Could not decode jpeg code stream",
        "[WARNING] [nvjpeg] plain, no colours",
    ]
    err = capfd.readouterr().err
    assert err == "a traceback line\n[not a log line\n\r 50%|#####     | progress"
    os.write(2, b"after\n")  # fd 2 is itself again
    assert capfd.readouterr().err == "after\n"


def test_overlapping_runs_share_one_redirect(capfd: pytest.CaptureFixture[str]) -> None:
    take_native_lines()
    inside, release = threading.Event(), threading.Event()

    def other_run() -> None:
        with quiet_native_stderr():
            inside.set()
            release.wait(10)
            os.write(2, NATIVE)

    thread = threading.Thread(target=other_run)
    with quiet_native_stderr():
        thread.start()
        inside.wait(10)
    os.write(2, NATIVE)  # the other run is still on: fd 2 is still the pipe
    release.set()
    thread.join(10)
    assert len(take_native_lines()) == 2
    assert capfd.readouterr().err == ""
    os.write(2, b"restored\n")
    assert capfd.readouterr().err == "restored\n"


def test_keep_leaves_the_console_alone(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GPULOAD_DALI_STDERR", "keep")
    with quiet_native_stderr():
        os.write(2, NATIVE)
    assert "libjpeg_turbo_decoder" in capfd.readouterr().err


@pytest.mark.skipif(not dali_installed(), reason="needs nvidia.dali (DALI), which is not installed here")
def test_dali_rejecting_files_with_skip_prints_nothing_and_logs_why(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    decoder = BatchDecoder("cpu", backend="dali-cpu", max_batch=4)
    bad = F.corrupt_inputs()
    encoded = [bad["truncated.jpg"], F.jpeg("grayscale"), bad["truncated.jpg"]]
    with caplog.at_level(logging.INFO, logger="gpuload.decode.dali"):
        result = decoder.decode(encoded, ["t1", "ok", "t2"], [0, 1, 2], on_error="skip")
    assert result.kept_positions == [1]
    assert "[ERROR]" not in capfd.readouterr().err
    assert any("Premature end of JPEG data" in record.getMessage() for record in caplog.records)
    assert "Premature end of JPEG data" in result.skipped[0][2]  # DALI's words join the reason


def test_a_child_started_during_a_run_neither_hangs_it_nor_loses_its_output(capfd: pytest.CaptureFixture[str]) -> None:
    import subprocess
    import sys
    import time

    script = "import sys, time; time.sleep(0.5); sys.stderr.write('late child\\n')"
    with quiet_native_stderr():
        child = subprocess.Popen([sys.executable, "-c", script])  # inherits the pipe as stderr
    started = time.monotonic()  # the run ended without waiting for the child
    assert child.poll() is None
    child.wait(10)
    seen = ""
    while "late child" not in seen and time.monotonic() - started < 5:
        time.sleep(0.05)
        seen += capfd.readouterr().err
    assert "late child" in seen


def test_someone_elses_redirect_during_a_run_is_kept(tmp_path, capfd: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "theirs.log"
    saved = os.dup(2)
    try:
        with quiet_native_stderr():
            with open(target, "wb") as theirs:
                os.dup2(theirs.fileno(), 2)  # e.g. a test harness switching captures
        os.write(2, b"still theirs\n")
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    assert target.read_bytes() == b"still theirs\n"


def test_lines_of_two_threads_interleaved_by_the_native_logger_are_kept(capfd: pytest.CaptureFixture[str]) -> None:
    take_native_lines()
    with quiet_native_stderr():
        os.write(2, b"\x1b[0;31m[ERROR] \x1b[0m\x1b[0;31m[ERROR] \x1b[0m[[libjpeg_turbo_decoder] Could not decode A\n")
        os.write(2, b"libjpeg_turbo_decoder] Could not decode B\nWarning: not DALI's\n")
    assert len(take_native_lines()) == 2
    assert capfd.readouterr().err == "Warning: not DALI's\n"


def test_a_line_holding_two_records_owes_the_next_line_to_them(capfd: pytest.CaptureFixture[str]) -> None:
    take_native_lines()
    with quiet_native_stderr():
        os.write(2, b"[ERROR] [libjpeg_turbo_decoder] [ERROR] [libjpeg_turbo_decoder] message A\nmessage B\n")
        os.write(2, b"message C is not DALI's\n")
    assert take_native_lines()[-1] == "message B"
    assert capfd.readouterr().err == "message C is not DALI's\n"


def test_a_flush_mark_cut_in_two_by_a_read_is_still_found() -> None:
    from gpuload.decode._stderr import _Redirect

    redirect = _Redirect()
    read_fd, write_fd = os.pipe()
    redirect.out_fd = write_fd
    mark = redirect._FLUSH
    rest = redirect._sort(b"[ERROR] [x] one\n" + mark[:5])
    assert rest == mark[:5]  # held back, not passed on
    data = rest + mark[5:]
    assert mark in data
    os.close(write_fd)
    assert os.read(read_fd, 100) == b""  # nothing reached the "console"
    os.close(read_fd)


def test_an_unfinished_line_that_is_not_dalis_is_passed_on_at_the_end(capfd: pytest.CaptureFixture[str]) -> None:
    take_native_lines()
    with quiet_native_stderr():
        os.write(2, b"[50%")  # could still become a log line: held until the run ends
    assert capfd.readouterr().err == "[50%" and take_native_lines() == []


def test_a_forked_child_writes_to_the_real_stderr_at_once(capfd: pytest.CaptureFixture[str]) -> None:
    with quiet_native_stderr():
        pid = os.fork()
        if pid == 0:  # the child: no reader thread here, fd 2 must be the real stderr again
            os.write(2, b"[ERROR] [child] from the child\n")
            os._exit(0)
        os.waitpid(pid, 0)
    assert "[ERROR] [child] from the child\n" in capfd.readouterr().err  # not kept: the child's own line


def test_without_a_stderr_to_duplicate_nothing_is_redirected(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuload.decode import _stderr

    def closed(fd: int) -> int:
        raise OSError(9, "Bad file descriptor")

    redirect = _stderr._Redirect()
    monkeypatch.setattr(_stderr.os, "dup", closed)
    assert redirect.enter() is False and redirect.users == 0 and redirect.read_fd == -1


def test_a_closed_descriptor_is_neither_the_same_file_nor_an_error_to_write_to() -> None:
    from gpuload.decode._stderr import _same_file, _write_all

    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    os.close(write_fd)
    assert _same_file(2, write_fd) is False
    _write_all(write_fd, b"lost")  # the real stderr is gone: the bytes are dropped, nothing raised


def test_after_a_fork_the_child_gets_its_stderr_back_and_starts_afresh(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """What ``os.register_at_fork`` runs in a forked child (whose coverage is not measured),
    run here on a redirect of its own in the state a child finds during a run: fd 2 on the
    pipe, no reader thread. fd 2 is the real stderr again, the pipe is closed, and the state is
    that of a redirect never used, so a run in the child redirects afresh."""
    from gpuload.decode import _stderr

    class NoReader:  # a forked child has no reader thread
        def __init__(self, **kwargs: object) -> None:
            pass

        def start(self) -> None:
            pass

    redirect = _stderr._Redirect()
    with monkeypatch.context() as patched:
        patched.setattr(_stderr.threading, "Thread", NoReader)
        assert redirect.enter()
    pipe = (redirect.read_fd, redirect.write_fd, redirect.out_fd)
    assert _stderr._same_file(2, redirect.write_fd)
    redirect.after_fork_in_child()
    assert (redirect.users, redirect.read_fd, redirect.write_fd, redirect.out_fd) == (0, -1, -1, -1)
    assert redirect.lines == [] and not redirect.flushed.is_set()
    for fd in pipe:  # the pipe's ends and the saved stderr: closed, none left open in the child
        with pytest.raises(OSError):
            os.fstat(fd)
    os.write(2, b"[ERROR] [child] straight to the real stderr\n")
    assert capfd.readouterr().err == "[ERROR] [child] straight to the real stderr\n"
