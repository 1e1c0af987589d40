"""Many arrays as one flat buffer, so that moving them between ranks is one collective."""

from typing import Any, List, Sequence

import numpy as np

__all__ = ["pack", "unpack"]


def pack(arrays: Sequence[Any], dtype: Any) -> np.ndarray:
    """`arrays` (anything `np.asarray` takes) flattened into one `dtype` buffer."""
    if not arrays:
        return np.zeros(0, dtype)
    return np.concatenate([np.asarray(a, dtype).reshape(-1) for a in arrays])


def unpack(flat: np.ndarray, like: Sequence[Any]) -> List[np.ndarray]:
    """Views of `flat` shaped as each of `like` (anything with a `shape`), in order."""
    out, start = [], 0
    for v in like:
        n = int(np.prod(v.shape))
        out.append(flat[start:start + n].reshape(tuple(v.shape)))
        start += n
    return out
