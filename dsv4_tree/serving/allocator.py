"""Page allocator: a free list of fixed-size pages (host bookkeeping, no tensors).

A pool of `num_pages` pages of `page_size` slots; slot = page * page_size + offset. Pages are
handed out lowest id first and returned on release, so after every request is released the
free count is back where it started."""
from __future__ import annotations

from ..errors import StateError


class PoolExhausted(StateError):
    """A pool has fewer free pages than a call needs (raised before anything is taken)."""


class PageAllocator:
    def __init__(self, name: str, num_pages: int, page_size: int):
        self.name, self.num_pages, self.page_size = name, num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() gives the lowest id

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def check(self, n: int) -> None:
        """Raise PoolExhausted unless n pages are free (nothing is taken)."""
        if n > len(self._free):
            raise PoolExhausted(
                f"{self.name} pool exhausted: needs {n} more pages of {self.page_size} slots, "
                f"{len(self._free)} of {self.num_pages} free; raise SpecConfig.max_requests / max_total_tokens"
            )

    def alloc(self, n: int) -> list:
        self.check(n)
        return [self._free.pop() for _ in range(n)]

    def free(self, pages) -> None:
        self._free.extend(sorted(pages, reverse=True))
        self._free.sort(reverse=True)
