"""What identifies a dataset's data on this node: its whole pickled state, and every file it names.

The disk tier keys an entry by a dataset's fingerprint (:mod:`gpuload.cache.disk`); for a
dataset of its own kind that is :func:`hash_state`: the dataset pickled (so ``__dict__``,
``__slots__``, nested datasets such as a ``Subset``'s, lists of paths, functions with their
code, defaults, closures and the plain values of the globals they read, classes not found by
name, defined inside a function or in code run without a module, with their methods), arrays
and tensors hashed by contents, and the identity of every existing file or folder a string anywhere
in that state names (:func:`file_identity`: size, mtime, ctime, inode; a folder: every file under
it). The ctime and inode change whenever a file is written or replaced, even when its size stays
and its mtime is put back (``cp -p``, ``rsync -t``), so a rewritten file never keys the old entry.
"""

from __future__ import annotations

import hashlib
import marshal
import os
import pickle
import stat
import sys
import types
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

__all__ = ["FOLDER_FILES", "IdentityError", "file_identity", "hash_array", "hash_state"]

FOLDER_FILES = 2_000_000
"""Files under one named folder beyond which the dataset is not identified (``cache_key=`` then):
listing them would take longer than a job's start should (about 1 s per 200,000 files)."""

_MAX_PATH = 4096
_SCALARS = frozenset({int, float, bool, type(None), bytes, tuple, list, dict})
_PLAIN = (str, bytes, int, float, complex, bool, type(None), tuple, list, dict, frozenset, set, os.PathLike)


class IdentityError(ValueError):
    """A dataset whose data cannot be identified from its state (it does not pickle, or names
    a folder too large to list): the disk tier needs ``cache_key=`` for it."""


def file_identity(path: str, status: os.stat_result | None = None) -> list[int]:
    """Size, mtime, ctime (ns) and inode of an existing file (``status``: its ``os.stat``, when
    taken already): any write or replacement changes one."""
    status = status or os.stat(path)
    return [status.st_size, status.st_mtime_ns, status.st_ctime_ns, status.st_ino]


def hash_array(hasher: Any, array: torch.Tensor | np.ndarray) -> None:
    """Feed an array's dtype, shape and bytes to ``hasher``, 64 MiB at a time (no copy of the whole)."""
    if isinstance(array, torch.Tensor):
        tensor = array.detach().cpu().contiguous()
        hasher.update(repr([str(tensor.dtype), list(tensor.shape)]).encode())
        data = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else np.empty(0, np.uint8)
    else:
        data_array = np.ascontiguousarray(array)
        hasher.update(repr([str(data_array.dtype), list(data_array.shape)]).encode())
        data = data_array.reshape(-1).view(np.uint8)
    step = 64 << 20
    for start in range(0, data.size, step):
        hasher.update(memoryview(data[start:start + step]))  # type: ignore[arg-type]  # numpy stubs: no __buffer__ before 3.12


def hash_state(obj: Any, hasher: Any, skip: Iterable[str | os.PathLike[str]] = ()) -> dict[str, list[Any]]:
    """Feed ``obj``'s whole pickled state to ``hasher``; return the files and folders it names,
    each absolute path with its :func:`file_identity` (a folder: ``["folder", [relative path,
    *identity], ...]``). Paths under ``skip`` (the cache's own folder) are left out.
    :class:`IdentityError` when the state does not pickle or a folder is too large to list."""
    pickler = _StatePickler(hasher, [os.path.abspath(os.fspath(s)) for s in skip])
    try:
        pickler.dump(obj)
    except IdentityError:
        raise
    except Exception as error:  # noqa: BLE001 - pickling runs any __reduce__ (RecursionError included)
        raise IdentityError(f"its state does not pickle ({type(error).__name__}: {error})") from None
    return dict(sorted(pickler.files.items()))


class _Writer:
    def __init__(self, hasher: Any) -> None:
        self.write = hasher.update


class _StatePickler(pickle.Pickler):
    """Pickles into a hasher; notes every path; arrays by a digest of their bytes; sets in a
    stable order; functions, and classes not found by name, by what they do."""

    def __init__(self, hasher: Any, skip: list[str]) -> None:
        super().__init__(_Writer(hasher), protocol=4)
        self.files: dict[str, list[Any]] = {}
        self.seen: set[str] = set()
        self.skip = skip
        # Each file's identity as this pass stat'ed it (a folder's listing, or the file named
        # itself), by absolute path: a file both listed and named is stat'ed once. Never kept
        # past the pass, so a file changed before the next fingerprint changes that one.
        self.stated: dict[str, list[int]] = {}

    def persistent_id(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is str:
            self._note(obj)
            return None
        if kind in _SCALARS:  # the most frequent objects, answered first
            return None
        if isinstance(obj, os.PathLike):
            self._note(obj)
            return None
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            digest = hashlib.blake2b(digest_size=16)
            hash_array(digest, obj)
            return ("array", type(obj).__name__, digest.hexdigest())
        if isinstance(obj, (set, frozenset)):  # iteration order varies between processes
            return (type(obj).__name__, sorted(self._digest(item) for item in obj))
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.FunctionType) and obj is not _same:
            return _same, (_function_state(obj),)
        if isinstance(obj, type) and not _by_name(obj):
            return _same, (_class_state(obj),)
        if isinstance(obj, types.ModuleType):
            return _same, (f"module {obj.__name__}",)
        return NotImplemented

    def _digest(self, item: Any) -> str:
        digest = hashlib.blake2b(digest_size=16)
        inner = _StatePickler(digest, self.skip)
        inner.seen = self.seen
        inner.stated = self.stated
        inner.dump(item)
        self.files.update(inner.files)
        return digest.hexdigest()

    def _note(self, value: str | os.PathLike[str]) -> None:
        text = os.fspath(value)
        if not isinstance(text, str) or text in self.seen or not text or len(text) > _MAX_PATH or "\0" in text:
            return
        self.seen.add(text)
        listed = self.stated.get(text)  # an absolute path a folder's listing has just stat'ed
        if listed is not None:
            if text not in self.files and not self._skipped(text):
                self.files[text] = listed
            return
        try:
            status = os.stat(text)
        except (OSError, ValueError):  # names no file: most strings
            return
        path = os.path.abspath(text)
        if path in self.files or os.path.dirname(path) == path or self._skipped(path):
            return  # the file system's root names no dataset's data
        try:
            if stat.S_ISDIR(status.st_mode):
                self.files[path] = ["folder", *self._folder(path)]
            else:
                self.files[path] = self.stated[path] = file_identity(path, status)
        except OSError as error:
            self.files[path] = [f"unreadable: {error.strerror}"]

    def _skipped(self, path: str) -> bool:
        return any(path == s or path.startswith(s + os.sep) for s in self.skip)

    def _folder(self, root: str) -> list[list[Any]]:
        """[relative path, *identity] of every file under ``root`` (symbolic links followed to
        files, not into folders), in order."""
        listed: list[list[Any]] = []
        for folder, folders, names in os.walk(root):
            folders[:] = sorted(f for f in folders if not self._skipped(os.path.join(folder, f)))
            under = os.path.relpath(folder, root)  # once a folder: relpath of each file took a third of a fingerprint
            # os.path.join's prefixes once a folder: joining each name took a third of what was left
            above, inside = ("" if under == os.curdir else os.path.join(under, "")), os.path.join(folder, "")
            for name in sorted(names):
                relative, path = above + name, inside + name
                try:
                    identity = self.stated.get(path) or self.stated.setdefault(path, file_identity(path))
                    listed.append([relative, *identity])
                except OSError as error:  # a dangling link, a file removed meanwhile
                    listed.append([relative, f"unreadable: {error.strerror}"])
                if len(listed) > FOLDER_FILES:
                    raise IdentityError(f"it names the folder {root}, which holds more than {FOLDER_FILES:,} files "
                                        "(too many to list at each start)")
        return listed


def _by_name(cls: type) -> bool:
    """Whether ``cls`` is found by its module and qualified name (as pickle finds classes): not
    one defined inside a function, or in code run without a module (``exec``)."""
    found: Any = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is cls


def _same(state: Any) -> Any:
    """What a function's or local class's identity unpickles to (it is never unpickled)."""
    return state


def _function_state(function: types.FunctionType) -> tuple[Any, ...]:
    """A function by what it does: its code, defaults, closure contents and the plain values
    of the globals it reads (a class in a closure, e.g. ``super()``'s, by its name)."""
    cells = []
    for cell in function.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not filled yet
            value = "<empty cell>"
        cells.append(f"class {value.__module__}.{value.__qualname__}" if isinstance(value, type) else value)
    space = function.__globals__
    read = {name: space[name] for name in sorted(_global_names(function.__code__))
            if name in space and isinstance(space[name], _PLAIN)}
    return ("function", function.__module__, function.__qualname__, marshal.dumps(function.__code__),
            function.__defaults__, function.__kwdefaults__, cells, read)


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _class_state(cls: type) -> tuple[Any, ...]:
    """A class defined inside a function by its bases and body (its methods' closures hold
    what the function gave it)."""
    body = {}
    for name, value in sorted(vars(cls).items()):
        if name in ("__dict__", "__weakref__", "__doc__", "__module__", "__qualname__"):
            continue
        if isinstance(value, (classmethod, staticmethod)):
            value = ("method", value.__func__)
        elif isinstance(value, property):
            value = ("property", value.fget, value.fset, value.fdel)
        elif not isinstance(value, (types.FunctionType, *_PLAIN)):
            value = f"{type(value).__module__}.{type(value).__qualname__}"
        body[name] = value
    bases = [f"{base.__module__}.{base.__qualname__}" if _by_name(base) else base for base in cls.__bases__]
    return ("class", cls.__module__, cls.__qualname__, bases, body)
