"""hello-large's model: `size_mib` MiB of float32 parameters in `num_tensors` tensors, made up
from `seed` (tensor i holds uniform [0, 1) values from the generator seeded with (seed, i)),
so every tensor has content of its own and the same arguments always give the same model.

The server never holds the whole model: the persistor hands the tensors over one at a time and
the server job stores each (at its content key) and drops it before the next one is made, so
the workflow starts from a model of refs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from fedhive.errors import InvalidArgument
from fedhive.fl.persistors import NumpyModelPersistor

MiB = 1024 * 1024
ROW = 1024  # tensors are (rows, 1024) when their size allows, else flat


def tensor_sizes(size_mib: float, num_tensors: int) -> list[int]:
    """Elements per tensor: equal shares of the model, the last one taking the remainder."""
    total = int(size_mib * MiB) // 4
    share = total // num_tensors
    if share == 0:
        raise InvalidArgument(f"{size_mib} MiB cannot be split into {num_tensors} tensors",
                              field="num_tensors")
    return [share] * (num_tensors - 1) + [total - share * (num_tensors - 1)]


def tensor_name(index: int) -> str:
    return f"layer{index:04d}.weight"


def generate(size_mib: float, num_tensors: int, seed: int = 0,
             ) -> Iterator[tuple[str, np.ndarray[Any, Any]]]:
    """(name, array) of the model, one tensor at a time."""
    for index, count in enumerate(tensor_sizes(size_mib, num_tensors)):
        values = np.random.default_rng([seed, index]).random(count, dtype=np.float32)
        shape = (count // ROW, ROW) if count % ROW == 0 else (count,)
        yield tensor_name(index), values.reshape(shape)
        del values  # before the next one is made


class GeneratedModelPersistor(NumpyModelPersistor):
    def __init__(self, size_mib: float = 256, num_tensors: int = 32, seed: int = 0,
                 final_file: str = "model.npz") -> None:
        super().__init__(final_file=final_file)
        if not isinstance(num_tensors, int) or num_tensors < 1:
            raise InvalidArgument(f"num_tensors must be a whole number >= 1, not "
                                  f"{num_tensors!r}", field="num_tensors")
        if not isinstance(size_mib, int | float) or size_mib <= 0:
            raise InvalidArgument(f"size_mib must be a positive number, not {size_mib!r}",
                                  field="size_mib")
        self.size_mib = size_mib
        self.num_tensors = num_tensors
        self.seed = seed
        tensor_sizes(size_mib, num_tensors)  # fails here, at start, for a model too small

    def _initial_items(self) -> Iterator[tuple[str, np.ndarray[Any, Any]]]:
        # The base persistor stores each tensor as it comes and drops it (refs, one at a time).
        yield from generate(self.size_mib, self.num_tensors, self.seed)
