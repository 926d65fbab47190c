"""numba's private names nbdist relies on (a cached dispatcher's on-disk index)."""

from __future__ import annotations

from typing import Any


def numba_cached(dispatcher: Any) -> bool:
    """Whether numba's on-disk cache holds a fresh compiled form of this ``cache=True`` function
    (its index is there and matches the source): loading it takes milliseconds, compiling seconds."""
    try:
        return bool(dispatcher._cache._cache_file._load_index())
    except Exception:  # no cache, or numba's layout changed: take it as not cached
        return False
