"""Memory hygiene for a long-lived trainer: give freed memory back after each round.

`clean_memory()` runs a full garbage collection, asks glibc to return free heap pages to the
system (`fedhive.heap.release_memory`; a no-op elsewhere) and, when torch is already imported
and CUDA is available, empties torch's CUDA cache.
"""

from __future__ import annotations

import sys

from fedhive.heap import release_memory


def clean_memory() -> dict[str, bool]:
    """What was done: {"gc", "malloc_trim", "cuda_empty_cache"}."""
    trimmed = release_memory()
    emptied = False
    torch = sys.modules.get("torch")  # never imported here: only a trainer that uses torch
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
        emptied = True
    return {"gc": True, "malloc_trim": trimmed, "cuda_empty_cache": emptied}
