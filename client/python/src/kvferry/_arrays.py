"""Views of caller arrays (numpy, torch CPU tensors, bytes) as numpy, without copying.

torch is never imported here: a tensor is recognised by its type's module, so the
package works (and imports fast) where torch is absent.
"""

from __future__ import annotations

import numpy as np

from kvferry._errors import invalid_argument

HEAD_DIM = 512      # bf16 values per token row
ROW_BYTES = 1024    # HEAD_DIM * 2


def is_torch_tensor(value) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "numpy")


def _torch_numpy(tensor, what: str) -> np.ndarray:
    """A numpy view of a CPU tensor's memory; bfloat16 becomes uint16 bits."""
    import torch  # present: `tensor` is one of its tensors

    if tensor.device.type != "cpu":
        raise invalid_argument(f"{what} must be a CPU tensor, got one on {tensor.device}")
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.detach().numpy()


def rows_bf16(rows, what: str = "rows") -> np.ndarray:
    """`rows` as a C-contiguous uint16 array [n, 512] of bf16 bits.

    Takes uint16 (or int16) numpy arrays and torch CPU tensors (bfloat16, int16), shaped
    [n, 512] or flat [n * 512], and bytes-like little-endian bf16 (n * 1024 bytes); copies
    only when the input is not contiguous.
    """
    if is_torch_tensor(rows):
        array = _torch_numpy(rows, what)
    elif isinstance(rows, (bytes, bytearray, memoryview)):
        data = byte_view(rows, what)
        if data.size % 2:
            raise invalid_argument(f"{what} holds {data.size} bytes, not whole bf16 values")
        array = data.view(np.uint16)
    else:
        array = np.asarray(rows)
    if array.dtype == np.int16:
        array = array.view(np.uint16)
    if array.dtype != np.uint16:
        raise invalid_argument(f"{what} must hold bf16 bits (uint16 or a bfloat16 tensor), "
                               f"got dtype {array.dtype}")
    if array.ndim == 1 and array.size % HEAD_DIM == 0:
        array = array.reshape(-1, HEAD_DIM)
    if array.ndim != 2 or array.shape[1] != HEAD_DIM:
        raise invalid_argument(f"{what} must be shaped [n, {HEAD_DIM}], got {list(array.shape)}")
    return np.ascontiguousarray(array)


def int64_vector(values, what: str) -> np.ndarray:
    """`values` (numpy, torch or a sequence of ints) as a 1-D int64 array."""
    array = _torch_numpy(values, what) if is_torch_tensor(values) else np.asarray(values)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise invalid_argument(f"{what} must be a 1-D integer array, got dtype {array.dtype} "
                               f"shape {list(array.shape)}")
    return array.astype(np.int64, copy=False)


def byte_view(data, what: str) -> np.ndarray:
    """A flat uint8 view of bytes, bytearray, memoryview, numpy or torch CPU data."""
    if is_torch_tensor(data):
        data = _torch_numpy(data.contiguous(), what)
    try:
        view = memoryview(data)
    except TypeError:
        raise invalid_argument(f"{what} must be bytes-like or an array, got "
                               f"{type(data).__name__}") from None
    if not view.c_contiguous:
        view = memoryview(np.ascontiguousarray(data))
    return np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view,
                         dtype=np.uint8)


def writable_bytes(out, what: str = "out") -> np.ndarray:
    """A writable flat uint8 view of all of `out` (numpy array, bytearray, writable
    memoryview or contiguous torch CPU tensor)."""
    if is_torch_tensor(out):
        if not out.is_contiguous():
            raise invalid_argument(f"{what} must be a contiguous tensor")
        out = _torch_numpy(out, what)
    try:
        view = memoryview(out)
    except TypeError:
        raise invalid_argument(f"{what} must be a writable buffer, got {type(out).__name__}") from None
    if view.readonly or not view.c_contiguous:
        raise invalid_argument(f"{what} must be writable and contiguous")
    return np.frombuffer(view.cast("B") if view.ndim != 1 or view.format != "B" else view,
                         dtype=np.uint8)


def torch_bf16(rows: np.ndarray):
    """A torch.bfloat16 CPU tensor sharing the memory of uint16 bf16 bits (no copy).
    Needs torch (an optional dependency)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(rows).view(np.int16)).view(torch.bfloat16)
