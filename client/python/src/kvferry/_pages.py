"""Page handles of one pool, and the mapping of int64 token locations onto them."""

from __future__ import annotations

import numpy as np

from kvferry._arrays import int64_vector
from kvferry._errors import invalid_argument


class Pages:
    """Handles of pages of one pool: ids and generations, with the pool's page size.

    A token location is the int64 `page_id * page_size + slot` (vLLM's slot mapping);
    write_tokens and read_workspace look each location's generation up here. A handle
    goes stale when its page is freed (the daemon then answers FAILED_PRECONDITION).
    Immutable; indexing (an int, slice, or array of positions) gives a subset.
    """

    def __init__(self, page_size: int, ids, generations):
        self.page_size = int(page_size)
        self.ids = np.array(ids, dtype=np.uint64).reshape(-1)
        self.generations = np.array(generations, dtype=np.uint64).reshape(-1)
        if self.page_size <= 0:
            raise invalid_argument(f"page_size must be positive, got {page_size}")
        if self.ids.shape != self.generations.shape:
            raise invalid_argument(f"{self.ids.size} page ids but {self.generations.size} "
                                   "generations")
        self.ids.flags.writeable = False
        self.generations.flags.writeable = False
        self._order = np.argsort(self.ids, kind="stable")
        sorted_ids = self.ids[self._order]
        if sorted_ids.size > 1 and (sorted_ids[1:] == sorted_ids[:-1]).any():
            raise invalid_argument("a page id appears twice among the handles")
        self._sorted_ids = sorted_ids

    def __len__(self) -> int:
        return int(self.ids.size)

    def __getitem__(self, index) -> "Pages":
        if isinstance(index, (int, np.integer)):
            index = [index]
        return Pages(self.page_size, self.ids[index], self.generations[index])

    def __repr__(self) -> str:
        return f"Pages(page_size={self.page_size}, ids={self.ids.tolist()})"

    def locate(self, locations, what: str = "locations"):
        """Splits int64 token locations into (page_ids, generations, slots) arrays.

        Raises Error(INVALID_ARGUMENT) for a negative location or one on a page that is
        not among these handles.
        """
        locations = int64_vector(locations, what)
        if locations.size and locations.min() < 0:
            raise invalid_argument(f"{what} must be non-negative")
        page_ids = (locations // self.page_size).astype(np.uint64)
        slots = (locations % self.page_size).astype(np.uint32)
        at = np.searchsorted(self._sorted_ids, page_ids)
        at_clipped = np.minimum(at, max(self._sorted_ids.size - 1, 0))
        known = (at < self._sorted_ids.size) & (
            self._sorted_ids[at_clipped] == page_ids if self._sorted_ids.size else False)
        if not np.all(known):
            first = int(np.argmin(known))
            raise invalid_argument(f"{what}[{first}] = {int(locations[first])} is on page "
                                   f"{int(page_ids[first])}, which is not among the handles given")
        generations = self.generations[self._order[at]]
        return page_ids, generations, slots
