"""Checking a published block a stripe at a time, as reads touch it: a job that opens a filled
entry checks only the stripes a batch reads (each once), so its first batch does not wait for
every block's checksum (a shuffled first batch touches every block).

A block's stripe checksums are its trailer (:func:`~gpuload.cache.disk.files.stripe_sums`), and
the manifest holds the checksum of the trailer: the first map of a block checks the trailer
against the manifest, then :meth:`StripeChecks.check` checks each stripe the first time a byte
range overlaps it.
"""

from __future__ import annotations

import numpy as np

from gpuload.cache.disk.files import STRIPE_BYTES, checksum


class StripeChecks:
    """Which stripes of one block file (``inode``) are still unchecked, and their checksums."""

    def __init__(self, inode: int, sums: np.ndarray) -> None:
        self.inode = inode
        self.sums = sums
        self.unchecked = np.ones(len(sums), dtype=bool)
        self.left = len(sums)

    def check(self, data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> int | None:
        """Check the unchecked stripes of ``data`` (the block's bytes) that the byte ranges
        ``[starts, ends)`` overlap; the first stripe whose bytes fail their checksum, else None."""
        if not self.left:
            return None
        reach = ends > starts  # an empty row touches no stripe
        first = starts[reach] // STRIPE_BYTES
        last = (ends[reach] - 1) // STRIPE_BYTES
        unchecked_before = np.concatenate(([0], np.cumsum(self.unchecked)))
        touched = unchecked_before[last + 1] > unchecked_before[first]
        for low, high in zip(first[touched].tolist(), last[touched].tolist()):
            for stripe in range(low, high + 1):
                if not self.unchecked[stripe]:
                    continue
                if checksum(data[stripe * STRIPE_BYTES:(stripe + 1) * STRIPE_BYTES]) != int(self.sums[stripe]):
                    return stripe
                self.unchecked[stripe] = False
                self.left -= 1
        return None

    def failing(self, data: np.ndarray) -> np.ndarray:
        """Check every stripe not checked yet; which stripes fail (a bool per stripe)."""
        bad = np.zeros(len(self.sums), dtype=bool)
        for stripe in np.flatnonzero(self.unchecked).tolist():
            if checksum(data[stripe * STRIPE_BYTES:(stripe + 1) * STRIPE_BYTES]) != int(self.sums[stripe]):
                bad[stripe] = True
            else:
                self.unchecked[stripe] = False
                self.left -= 1
        return bad
