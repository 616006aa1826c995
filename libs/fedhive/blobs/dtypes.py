"""The dtypes a `TensorRef` may carry, and zero-copy conversion between arrays and flat bytes.

Wire format: the array's elements in C order, little-endian, no header; `dtype` and `shape`
travel in the ref. Names are numpy's ("float32", "bool", ...) plus "bfloat16".

bfloat16: numpy has no bfloat16 dtype. Torch bfloat16 tensors round-trip as torch bfloat16.
When a bfloat16 ref is materialised as numpy (a caller asks for numpy output, e.g. a
trainer without torch), the result is a `uint16` array holding the raw bfloat16 bit patterns:
bit-exact, zero-copy, and widened losslessly to float32 by `bfloat16_bits_to_float32`.
Numpy input never produces a bfloat16 ref (a uint16 array stays "uint16").

torch is imported only when a torch tensor is packed or a torch ref is materialised, so
numpy-only processes never pay for it.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import numpy as np
import numpy.typing as npt

from fedhive.errors import InvalidArgument

ByteArray = npt.NDArray[np.uint8]

# wire name -> numpy storage dtype (little-endian). bfloat16 is stored as its uint16 bits.
_NUMPY: dict[str, np.dtype[Any]] = {
    name: np.dtype(name).newbyteorder("<")
    for name in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
}
_NUMPY["bfloat16"] = np.dtype("<u2")
DTYPES = frozenset(_NUMPY)


def itemsize(dtype: str, tensor: str) -> int:
    try:
        return _NUMPY[dtype].itemsize
    except KeyError:
        raise InvalidArgument(
            f"tensor {tensor!r} has unsupported dtype {dtype!r} "
            f"(supported: {', '.join(sorted(DTYPES))})",
            field="dtype",
        ) from None


def _torch() -> Any:
    try:
        return importlib.import_module("torch")
    except ImportError:
        raise InvalidArgument(
            "torch is not installed: materialise torch refs as numpy instead", field="kind"
        ) from None


def is_torch_tensor(value: object) -> bool:
    torch = sys.modules.get("torch")  # a tensor can only exist if torch is already imported
    return torch is not None and isinstance(value, torch.Tensor)


def numpy_to_bytes(name: str, array: npt.NDArray[Any]) -> tuple[ByteArray, str]:
    """A flat uint8 view of `array` (copied only if non-contiguous or big-endian)."""
    wire = array.dtype.name
    if wire not in _NUMPY or wire == "bfloat16":
        raise InvalidArgument(f"tensor {name!r} has unsupported dtype {wire!r}", field="dtype")
    contiguous = np.ascontiguousarray(array, dtype=_NUMPY[wire])
    return contiguous.reshape(-1).view(np.uint8), wire


def torch_to_bytes(name: str, tensor: Any) -> tuple[ByteArray, str]:
    """A flat uint8 numpy view sharing the (contiguous, CPU) tensor's memory."""
    torch = _torch()
    wire = str(tensor.dtype).removeprefix("torch.")
    if wire not in _NUMPY:
        raise InvalidArgument(f"tensor {name!r} has unsupported dtype {wire!r}", field="dtype")
    plain = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()
    flat: ByteArray = plain.reshape(-1).view(torch.uint8).numpy()
    return flat, wire


def bytes_to_numpy(buffer: ByteArray, dtype: str, shape: tuple[int, ...]) -> npt.NDArray[Any]:
    """View a flat uint8 buffer as the array it holds (no copy)."""
    return buffer.view(_NUMPY[dtype]).reshape(shape)


def bytes_to_torch(buffer: ByteArray, dtype: str, shape: tuple[int, ...]) -> Any:
    """A torch tensor over the same memory as `buffer` (no copy)."""
    torch = _torch()
    if buffer.size == 0:  # torch cannot reinterpret an empty byte tensor's (zero) stride
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.from_numpy(buffer).view(getattr(torch, dtype)).reshape(shape)


def bfloat16_bits_to_float32(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    """Widen raw bfloat16 bit patterns to float32 exactly (bfloat16 is float32's top half)."""
    widened: npt.NDArray[np.float32] = (bits.astype(np.uint32) << 16).view(np.float32)
    return widened
