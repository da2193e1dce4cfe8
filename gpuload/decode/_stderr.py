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
  back exactly once, when the last run ends. The pipe and its reader thread then stay, so a
  child process started during a run, which inherited the pipe as its stderr, is still read
  and passed on: nothing waits for the pipe to close or blocks on a full one. A forked child
  gets its real stderr back at once (``os.register_at_fork``).
- Code that points fd 2 elsewhere itself while a run is on (pytest's capture between two
  tests) keeps its change: fd 2 is put back only if it still is the pipe.
- Lines are passed to ``logging`` by the decoding thread after its run, never by the reader
  thread, which could otherwise block on the pipe it alone drains.
- Not done where ``os.dup`` fails (fd 2 closed) or on platforms without ``os.pipe``, and never
  when ``GPULOAD_DALI_STDERR=keep`` is set.
- What it cannot promise: if the process dies from a signal during a run (a segfault inside
  DALI), bytes still in the pipe die with the reader. Set ``GPULOAD_DALI_STDERR=keep`` when
  debugging a crash. Output of other threads during a run reaches the console a moment later
  (through the reader), in order.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from gpuload.environment import dali_stderr

__all__ = ["quiet_native_stderr", "take_native_lines", "LOGGER"]

LOGGER = logging.getLogger("gpuload.decode.dali")

# "\x1b[0;31m[ERROR] \x1b[0m[libjpeg_turbo_decoder] Could not decode ...", colours optional.
# The logger writes the level, the component and the message in separate writes, so lines of
# two decoding threads can interleave: "[ERROR] [ERROR] [[libjpeg..." then "libjpeg...] Could".
# A line is DALI's if it starts with a level tag, or with a component tag ("[name] " or, its
# "[" taken by the other line, "name] "); a line holding n level tags owes the next n - 1 lines
# to the same records (each record ends with one newline).
_LEVEL = r"\[(?:FATAL|ERROR|WARNING|INFO|DEBUG|TRACE)\] "
_COMPONENT = r"\[?[a-z][a-z0-9_]*\] "
_NATIVE_LINE = re.compile(rf"(?:{_LEVEL}|{_COMPONENT})")
_LEVELS = re.compile(_LEVEL)
_ANSI_CODES = re.compile(r"\x1b\[[0-9;]*m")
_MAX_KEPT = 1000  # lines waiting for take_native_lines; older ones are dropped


class _Redirect:
    """fd 2 pointed at a pipe while ``users`` > 0; one reader thread drains the pipe for good.

    The pipe and its reader live as long as the process, so a child started during a run
    (``subprocess``, a forked worker) that inherited the pipe as its stderr is still read and
    passed on after the run: nothing waits for the pipe to close, nothing blocks on a full one.
    At the end of a run a flush mark goes through the pipe, so the lines written during the run
    are sorted before :func:`take_native_lines` looks.
    """

    _FLUSH = b"\x00gpuload-stderr-flush\x00"

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.read_fd = self.write_fd = self.out_fd = -1
        self.out_lock = threading.Lock()
        self.flushed = threading.Event()
        self.lines: list[str] = []
        self.lines_lock = threading.Lock()
        self.owed = 0  # lines still due to records interleaved into an earlier line

    def enter(self) -> bool:
        with self.lock:
            if self.users == 0 and not self._redirect():
                return False
            self.users += 1
            return True

    def leave(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0:
                if _same_file(2, self.write_fd):  # else someone pointed fd 2 elsewhere meanwhile: keep theirs
                    os.dup2(self.out_fd, 2)
                self.flushed.clear()
                _write_all(self.write_fd, self._FLUSH)
                self.flushed.wait(timeout=2.0)

    def _redirect(self) -> bool:
        try:
            current = os.dup(2)  # the stderr of now: it may have changed since the last run
        except OSError:
            return False
        if self.read_fd < 0:
            self.read_fd, self.write_fd = os.pipe()
            threading.Thread(target=self._drain, name="gpuload-dali-stderr", daemon=True).start()
        with self.out_lock:
            if self.out_fd >= 0:
                os.close(self.out_fd)
            self.out_fd = current
        os.dup2(self.write_fd, 2)
        return True

    def after_fork_in_child(self) -> None:
        """A forked child has no reader thread: give it its stderr back and start afresh."""
        if self.users > 0 and self.out_fd >= 0:
            os.dup2(self.out_fd, 2)
        for fd in (self.read_fd, self.write_fd, self.out_fd):
            if fd >= 0:
                os.close(fd)
        self.__init__()  # type: ignore[misc]

    def _drain(self) -> None:
        pending = b""
        while chunk := os.read(self.read_fd, 65536):
            data = pending + chunk
            while self._FLUSH in data:
                before, data = data.split(self._FLUSH, 1)
                rest = self._sort(before)
                if rest and not self._keep(rest):
                    self._pass(rest)  # an unfinished line, as it was written
                self.flushed.set()
            pending = self._sort(data)

    def _pass(self, data: bytes) -> None:
        with self.out_lock:
            _write_all(self.out_fd, data)

    def _sort(self, data: bytes) -> bytes:
        """Keep DALI's complete lines, pass the rest on; returns a partial line to wait for."""
        *lines, rest = data.split(b"\n")
        passed = [line + b"\n" for line in lines if not self._keep(line)]
        if rest and not _could_be_native(rest):
            passed.append(rest)  # a progress bar's "\r..." goes on without waiting for a newline
            rest = b""
        if passed:
            self._pass(b"".join(passed))
        return rest

    def _keep(self, line: bytes) -> bool:
        """Keep ``line`` if it is one of DALI's log lines; False to pass it on."""
        text = _ANSI_CODES.sub("", line.decode("utf-8", "replace"))
        if self.owed:  # the rest of a record whose level tag came in an earlier, interleaved line
            self.owed -= 1
        elif _NATIVE_LINE.match(text):
            self.owed = max(0, len(_LEVELS.findall(text)) - 1)
        else:
            return False
        with self.lines_lock:
            self.lines.append(text.strip())
            del self.lines[:-_MAX_KEPT]
        return True


def _same_file(fd_a: int, fd_b: int) -> bool:
    try:
        a, b = os.fstat(fd_a), os.fstat(fd_b)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


# ... or the start of the flush mark, cut by a read in two.
_NATIVE_START = re.compile(rb"(?:\x1b\[|\[|\x00|[a-z][a-z0-9_]*(?:\]|$))")


def _could_be_native(partial: bytes) -> bool:
    """Whether an unfinished line may still turn out to be DALI's (then it waits for its end)."""
    return bool(_NATIVE_START.match(partial))


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            written = os.write(fd, data)
        except OSError:
            return  # the real stderr is gone; nothing better to do with the bytes
        data = data[written:]


_redirect = _Redirect()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_redirect.after_fork_in_child)


@contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Around one DALI run: its native log lines go to :func:`take_native_lines`, not the console."""
    if dali_stderr() == "keep" or not hasattr(os, "pipe"):
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
