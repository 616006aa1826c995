"""Memory hygiene for a long-lived trainer: give freed memory back after each round.

`clean_memory()` runs a full garbage collection, asks glibc to return free heap pages to the
system (`malloc_trim(0)`; a no-op elsewhere) and, when torch is already imported and CUDA is
available, empties torch's CUDA cache.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
from functools import cache
from typing import Any


@cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def clean_memory() -> dict[str, bool]:
    """What was done: {"gc", "malloc_trim", "cuda_empty_cache"}."""
    gc.collect()
    libc = _libc()
    trimmed = False
    if libc is not None:
        libc.malloc_trim(0)
        trimmed = True
    emptied = False
    torch = sys.modules.get("torch")  # never imported here: only a trainer that uses torch
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
        emptied = True
    return {"gc": True, "malloc_trim": trimmed, "cuda_empty_cache": emptied}
