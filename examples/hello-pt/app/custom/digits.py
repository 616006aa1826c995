"""scikit-learn's bundled 8x8 handwritten digits (1,797 images, no download), split the same
way at every site: a fixed 20% held-out test split shared by all, and the rest cut into
`num_sites` disjoint training shards, one per site by the number its name ends with (`site-1`
gets shard 0, `site-2` shard 1, ...; a name without a number gets a shard by a stable hash).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import numpy as np
from sklearn.datasets import load_digits

TEST_FRACTION = 0.2
SPLIT_SEED = 0

Arrays = tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]


def site_index(site: str, num_sites: int) -> int:
    match = re.search(r"(\d+)$", site)
    if match:
        return (int(match.group(1)) - 1) % num_sites
    return int(hashlib.sha256(site.encode()).hexdigest(), 16) % num_sites


def split(num_sites: int) -> tuple[list[Arrays], Arrays]:
    """The training shards (one per site index) and the held-out test split."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)  # pixels are 0..16
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(y))
    n_test = int(len(y) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    shards = [(x[part], y[part]) for part in np.array_split(train, num_sites)]
    return shards, (x[test], y[test])


def site_data(site: str, num_sites: int) -> tuple[Arrays, Arrays]:
    """This site's training shard and the shared test split."""
    shards, test = split(num_sites)
    return shards[site_index(site, num_sites)], test
