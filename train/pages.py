"""The page allocator of the serving engine (:mod:`train.engine`): a free list, reference counts, reservations.

Pages are indices into every attention layer's pool ``(P, Z, K, D)``. A request takes pages as it grows and gives
them back when it ends; requests that start from the same prompt hold its whole pages together (one reference
each), and a page returns to the free list when its last reference goes. A request reserves its worst case when it
is admitted, so a running request never finds the pool empty (no preemption needed).
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["PagePool", "PageStats", "pages_for"]


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` keys."""
    return -(-tokens // page_size)


@dataclasses.dataclass
class PageStats:
    """What the pool did: pages handed out, of them reused (a page freed before), references shared, the peak."""

    allocated: int = 0
    reused: int = 0
    shared: int = 0
    peak: int = 0


class PagePool:
    """``num_pages`` pages of ``page_size`` tokens: allocate, share, release, reserve."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self.free: list[int] = list(range(num_pages))[::-1]  # a stack: the page freed last is taken first
        self.refs = np.zeros(num_pages, np.int64)
        self.used = np.zeros(num_pages, bool)  # held at least once
        self.reserved = 0
        self.stats = PageStats()

    @property
    def in_use(self) -> int:
        """Pages held by at least one reference."""
        return self.num_pages - len(self.free)

    def can_reserve(self, pages: int) -> bool:
        """Whether ``pages`` more can be promised (free pages not yet promised to admitted requests)."""
        return len(self.free) - self.reserved >= pages

    def reserve(self, pages: int) -> None:
        if not self.can_reserve(pages):
            raise RuntimeError(f"cannot reserve {pages} pages: {len(self.free)} free, {self.reserved} reserved")
        self.reserved += pages

    def unreserve(self, pages: int) -> None:
        self.reserved -= pages

    def allocate(self) -> int:
        """A free page, one reference (out of a reservation made before)."""
        page = self.free.pop()
        self.reserved -= 1
        self.refs[page] = 1
        self.stats.allocated += 1
        self.stats.reused += int(self.used[page])
        self.used[page] = True
        self.stats.peak = max(self.stats.peak, self.in_use)
        return page

    def share(self, page: int) -> int:
        """One more reference to a held page."""
        if self.refs[page] <= 0:
            raise RuntimeError(f"page {page} is not held: it cannot be shared")
        self.refs[page] += 1
        self.stats.shared += 1
        return page

    def release(self, pages: list[int]) -> None:
        """One reference fewer to each of ``pages``; pages left without one go back to the free list."""
        for page in pages:
            if self.refs[page] <= 0:
                raise RuntimeError(f"page {page} released more often than held")
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free.append(page)
