"""Keep DALI's native log lines off the console and hand them to Python's ``logging``.

DALI's decoders (through nvImageCodec) print ``[ERROR] [libjpeg_turbo_decoder] ...`` straight
to file descriptor 2 from C++ for every file they reject, even when gpuload then skips the file
as asked (``on_error="skip"``). DALI offers no Python hook for these messages:
``DALI_NVIMGCODEC_LOG_LEVEL`` goes down to 1, which still prints errors, and ``DALI_LOG_FILE``
only receives statistics. So while a DALI batch runs, fd 2 is pointed at a pipe; a small thread
reads it and sorts what comes through: DALI's log lines are kept for the logger
``gpuload.decode.dali`` (at INFO, so not shown unless logging is configured to show it), every
other byte is written on at once to the real stderr (other threads keep printing: tracebacks,
warnings, progress bars).

Why it is safe enough to do by default, and where it is not done:

- One redirect is shared by overlapping runs (two loaders' threads), counted, so fd 2 is put
  back exactly once, when the last run ends; the thread is joined then, so nothing is lost on
  the way.
- Lines are passed to ``logging`` by the decoding thread after its run, never by the reader
  thread, which could otherwise block on the pipe it alone drains.
- Not done where ``os.dup`` fails (fd 2 closed) or on platforms without ``os.pipe``, and never
  when ``GPULOAD_DALI_STDERR=keep`` is set.
- The one thing it cannot promise: if the process is killed by a signal during a run (a
  segfault inside DALI), bytes still in the pipe die with the reader thread. Set
  ``GPULOAD_DALI_STDERR=keep`` when debugging a crash.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["quiet_native_stderr", "take_native_lines", "LOGGER"]

LOGGER = logging.getLogger("gpuload.decode.dali")

# "\x1b[0;31m[ERROR] \x1b[0m[libjpeg_turbo_decoder] Could not decode ...", colours optional.
_ANSI = r"(?:\x1b\[[0-9;]*m)?"
_NATIVE_LINE = re.compile(_ANSI + r"\[(FATAL|ERROR|WARNING|INFO|DEBUG|TRACE)\] " + _ANSI + r"\[")
_ANSI_CODES = re.compile(r"\x1b\[[0-9;]*m")
_MAX_KEPT = 1000  # lines waiting for take_native_lines; older ones are dropped


class _Redirect:
    """fd 2 pointed at a pipe, drained by a thread, for as long as ``users`` > 0."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.saved_fd = -1
        self.write_fd = -1
        self.reader: threading.Thread | None = None
        self.lines: list[str] = []
        self.lines_lock = threading.Lock()

    def enter(self) -> bool:
        with self.lock:
            if self.users == 0 and not self._start():
                return False
            self.users += 1
            return True

    def leave(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0:
                self._stop()

    def _start(self) -> bool:
        try:
            saved = os.dup(2)
        except OSError:
            return False
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 2)
        self.saved_fd, self.write_fd = saved, write_fd
        self.reader = threading.Thread(
            target=self._drain, args=(read_fd, saved), name="gpuload-dali-stderr", daemon=True
        )
        self.reader.start()
        return True

    def _stop(self) -> None:
        os.dup2(self.saved_fd, 2)
        os.close(self.write_fd)  # with fd 2 restored, the reader now sees the end of the pipe
        if self.reader is not None:
            self.reader.join()
        os.close(self.saved_fd)
        self.reader, self.saved_fd, self.write_fd = None, -1, -1

    def _drain(self, read_fd: int, out_fd: int) -> None:
        pending = b""
        try:
            while chunk := os.read(read_fd, 65536):
                pending = self._sort(pending + chunk, out_fd)
            if pending and not self._keep(pending):
                _write_all(out_fd, pending)  # an unfinished line, as it was written
        finally:
            os.close(read_fd)

    def _sort(self, data: bytes, out_fd: int) -> bytes:
        """Keep DALI's complete lines, pass the rest on; returns a partial line to wait for."""
        *lines, rest = data.split(b"\n")
        passed = []
        for line in lines:
            if not self._keep(line):
                passed.append(line + b"\n")
        if rest and not _could_be_native(rest):
            passed.append(rest)  # a progress bar's "\r..." goes on without waiting for a newline
            rest = b""
        if passed:
            _write_all(out_fd, b"".join(passed))
        return rest

    def _keep(self, line: bytes) -> bool:
        """Keep ``line`` if it is one of DALI's log lines; False to pass it on."""
        text = line.decode("utf-8", "replace")
        if not _NATIVE_LINE.match(text):
            return False
        with self.lines_lock:
            self.lines.append(_ANSI_CODES.sub("", text).strip())
            del self.lines[:-_MAX_KEPT]
        return True


def _could_be_native(partial: bytes) -> bool:
    return partial.startswith((b"\x1b[", b"["))


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            written = os.write(fd, data)
        except OSError:
            return  # the real stderr is gone; nothing better to do with the bytes
        data = data[written:]


_redirect = _Redirect()


@contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Around one DALI run: its native log lines go to :func:`take_native_lines`, not the console."""
    if os.environ.get("GPULOAD_DALI_STDERR", "").lower() == "keep" or not hasattr(os, "pipe"):
        yield
        return
    entered = _redirect.enter()
    try:
        yield
    finally:
        if entered:
            _redirect.leave()


def take_native_lines() -> list[str]:
    """DALI's log lines caught so far (colour codes removed), emptied; also logged at INFO."""
    with _redirect.lines_lock:
        lines, _redirect.lines = _redirect.lines, []
    for line in lines:
        LOGGER.info("%s", line)
    return lines
