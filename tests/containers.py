"""Batch containers that torch's collate never makes, for code that must rebuild or give up cleanly."""

from __future__ import annotations

from collections.abc import Iterator, Mapping


class Fields(Mapping):
    """A read-only mapping whose constructor takes keywords, not a dict: whoever rebuilds one
    from its items gets a TypeError and must fall back to a plain dict."""

    def __init__(self, **fields: object) -> None:
        self._fields = fields

    def __getitem__(self, key: str) -> object:
        return self._fields[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)
