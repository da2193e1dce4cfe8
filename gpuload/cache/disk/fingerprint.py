"""What produced a disk-tier entry's bytes: a :class:`Fingerprint` of arrays, image files or any
map-style dataset (its pickled state and the files it names, :mod:`gpuload.cache.identity`), or
of the caller's ``cache_key``. Another fingerprint never reads an entry's bytes."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpuload.cache.entries import FORMAT_VERSION
from gpuload.cache.identity import IdentityError, file_identity, hash_array, hash_state
from gpuload.datasets.arrays import ArrayDataset
from gpuload.datasets.images import ImageFiles


@dataclass(frozen=True)
class Fingerprint:
    """What produced an entry's bytes: ``kind`` (``arrays``, ``images``, ``dataset``), a short
    human ``description`` and ``digest``, a hash of everything that identifies the bytes
    (class, length, files with sizes, mtimes, ctimes and inodes, settings, :data:`FORMAT_VERSION`)."""

    kind: str
    description: str
    digest: str

    @classmethod
    def of(cls, kind: str, description: str, parts: Any) -> Fingerprint:
        """The fingerprint of ``parts`` (JSON-like data, or a blake2b hasher already fed)."""
        hasher = hashlib.blake2b(digest_size=16)
        hasher.update(json.dumps({"format": FORMAT_VERSION, "kind": kind}, sort_keys=True).encode())
        if isinstance(parts, type(hasher)):
            hasher.update(parts.digest())
        else:
            hasher.update(canonical(parts))
        return cls(kind, description, hasher.hexdigest())


def canonical(value: Any) -> bytes:
    """``value`` as canonical JSON bytes (keys sorted), what every digest of the disk tier hashes."""
    return json.dumps(value, sort_keys=True, default=_stable_repr, separators=(",", ":")).encode()


def _stable_repr(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(map(repr, value))
    if isinstance(value, (os.PathLike,)):
        return os.fspath(value)
    if isinstance(value, (torch.dtype, np.dtype, torch.device)):
        return str(value)
    text = repr(value)
    if " at 0x" in text:
        raise ValueError(
            f"the disk cache's fingerprint cannot use {text}: its repr changes from run to run; pass "
            "settings made of numbers, strings, lists and dicts (or objects with a stable repr)"
        )
    return f"{type(value).__module__}.{type(value).__qualname__}:{text}"


def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def fingerprint_arrays(arrays: Any, settings: Mapping[str, Any] | None = None, *,
                       key: str | None = None) -> Fingerprint:
    """The fingerprint of in-memory arrays (a tensor, an ndarray, a tuple/list/dict of them, or
    an :class:`~gpuload.datasets.ArrayDataset`): their dtypes, shapes and contents (hashed; about
    a second per GB on one core), or with ``key`` (a string the caller changes whenever the
    contents change) their dtypes and shapes and the key."""
    columns = arrays.columns if isinstance(arrays, ArrayDataset) else arrays
    if isinstance(columns, (torch.Tensor, np.ndarray)):
        columns = {"#0": columns}
    elif isinstance(columns, (tuple, list)):
        columns = {f"#{i}": a for i, a in enumerate(columns)}
    if not isinstance(columns, Mapping) or not columns or not all(
        isinstance(a, (torch.Tensor, np.ndarray)) for a in columns.values()
    ):
        raise TypeError(
            f"fingerprint_arrays takes tensors or numpy arrays (one, or a tuple/list/dict of them), "
            f"not {type(arrays).__name__}"
        )
    hasher = hashlib.blake2b(digest_size=16)
    hasher.update(canonical({"class": _class_name(arrays), "settings": dict(settings or {}), **_keyed(key)}))
    for name in sorted(columns):
        hasher.update(canonical(name))
        if key is None:
            hash_array(hasher, columns[name])
        else:
            hasher.update(canonical([str(columns[name].dtype), list(columns[name].shape)]))
    first = next(iter(columns.values()))
    return Fingerprint.of("arrays", f"{type(arrays).__name__}({len(first)} rows, {len(columns)} columns)", hasher)


def fingerprint_images(dataset: Any, settings: Mapping[str, Any] | None = None, *,
                       key: str | None = None) -> Fingerprint:
    """The fingerprint of image files (a gpuload ImageFolder/ImageList or anything with a
    torchvision-style ``samples`` list of ``(path, label)``): the class, each file's absolute
    path, label and :func:`~gpuload.cache.identity.file_identity` (size, mtime, ctime, inode),
    and ``settings`` (decode size, pre-cache transforms). Changing, replacing, adding or
    removing a file changes it. With ``key``, the paths and labels and the key (no file is
    looked at)."""
    samples = getattr(dataset, "samples", None)
    if not isinstance(samples, Sequence) or isinstance(samples, (str, bytes)):
        raise TypeError(f"fingerprint_images needs a dataset with a samples list of (path, label), not {dataset!r}")
    hasher = hashlib.blake2b(digest_size=16)
    hasher.update(canonical({"class": _class_name(dataset), "length": len(samples), "settings": dict(settings or {}),
                              **_keyed(key)}))
    for path, label in samples:
        full = os.path.abspath(os.fspath(path))
        try:
            identity: Sequence[int | str] = file_identity(full) if key is None else []
        except OSError as error:
            identity = [f"unreadable: {error.strerror}"]
        hasher.update(canonical([full, int(label), *identity]))
    return Fingerprint.of("images", f"{type(dataset).__name__}({len(samples)} images)", hasher)


def fingerprint_dataset(dataset: Any, settings: Mapping[str, Any] | None = None, key: str | None = None,
                        skip: Sequence[str | os.PathLike[str]] = ()) -> Fingerprint:
    """The fingerprint of any map-style dataset: its class, its length, the identity of the
    file that defines the class, and either ``key`` (a string the caller promises changes with
    the samples: data, transforms, code) or :func:`~gpuload.cache.identity.hash_state`: the
    dataset's whole pickled state (attributes, slots, nested datasets, functions with their
    closures, arrays by contents) and the identity of every file or folder (each file under it)
    a string anywhere in it names, but those under ``skip`` (the cache's folder).

    :class:`~gpuload.cache.identity.IdentityError` (a ValueError) when that state does not
    pickle (open files, locks, database handles) or names a folder of more than
    :data:`~gpuload.cache.identity.FOLDER_FILES` files: a fingerprint that would not notice
    the data change is worse than none. Data read from elsewhere (a database, a URL) is only
    seen through ``key=``.
    """
    parts: dict[str, Any] = {"class": _class_name(dataset), "settings": dict(settings or {})}
    try:
        parts["length"] = len(dataset)
    except TypeError:
        raise TypeError(
            f"the disk cache stores map-style datasets with a length; {type(dataset).__name__} has none"
        ) from None
    source = sys.modules.get(type(dataset).__module__)
    source_file = getattr(source, "__file__", None)
    if source_file and os.path.exists(source_file):
        parts["code"] = [os.path.abspath(source_file), *file_identity(source_file)]
    hasher = hashlib.blake2b(digest_size=16)
    if key is not None:
        parts.update(_keyed(key))
    else:
        try:
            parts["files"] = hash_state(dataset, hasher, skip)
        except IdentityError as error:
            raise IdentityError(
                f"the disk cache cannot identify {type(dataset).__name__}: {error}; pass cache_key= (a string you "
                "change whenever its samples change), or no cache_dir"
            ) from None
    hasher.update(canonical(parts))
    return Fingerprint.of("dataset", f"{type(dataset).__name__}({parts['length']} samples)", hasher)


def _keyed(key: str | None) -> dict[str, str]:
    """The caller's key as a fingerprint part (none without one); a key must be a non-empty string."""
    if key is None:
        return {}
    if not isinstance(key, str) or not key.strip():
        raise ValueError(f"cache_key={key!r} must be a non-empty string that changes whenever the data does")
    return {"key": key}


def fingerprint_for(dataset: Any, settings: Mapping[str, Any] | None = None, *, key: str | None = None,
                    skip: Sequence[str | os.PathLike[str]] = ()) -> Fingerprint:
    """The fingerprint of ``dataset``: image files (:func:`fingerprint_images`), arrays
    (:func:`fingerprint_arrays`) or any other dataset (:func:`fingerprint_dataset`; ``skip``:
    folders whose files are not its data).

    ``settings``: what else shapes the stored bytes, e.g. ``{"decode_size": [224, 224],
    "pre_cache": ["Resize(256)", "CenterCrop(224)"]}``. Random augmentations run after the
    cache and are never part of it. ``key``: a string the caller changes whenever the data
    does, used instead of looking at the files, contents or state.
    """
    if isinstance(dataset, ImageFiles) or _has_image_samples(dataset):
        return fingerprint_images(dataset, settings, key=key)
    parts = dataset.values() if isinstance(dataset, Mapping) else dataset
    if isinstance(dataset, (ArrayDataset, torch.Tensor, np.ndarray)) or (
        isinstance(dataset, (tuple, list, Mapping)) and dataset
        and all(isinstance(a, (torch.Tensor, np.ndarray)) for a in parts)
    ):
        return fingerprint_arrays(dataset, settings, key=key)
    return fingerprint_dataset(dataset, settings, key=key, skip=skip)


def _has_image_samples(dataset: Any) -> bool:
    samples = getattr(dataset, "samples", None)
    return (
        isinstance(samples, Sequence) and not isinstance(samples, (str, bytes)) and len(samples) > 0
        and all(isinstance(s, Sequence) and len(s) == 2 and isinstance(s[0], (str, os.PathLike)) for s in samples[:16])
    )
