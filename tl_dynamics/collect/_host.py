"""Moving many small results off the device in one read per dtype, not one per tensor."""

from __future__ import annotations

import torch
from torch import Tensor


def to_host(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The same tensors on the CPU, packed per dtype into one buffer each and read with one
    transfer per dtype (each ``.cpu()`` waits for the device). On the CPU the packing is one
    small copy, done all the same so that the code after it is the same on every device.

    Example:
        >>> import torch
        >>> out = to_host({"a": torch.ones(2, 3), "b": torch.arange(4)})
        >>> out["a"].shape, out["b"].tolist()
        (torch.Size([2, 3]), [0, 1, 2, 3])
    """
    on_device = dict(tensors)
    out = dict(tensors)
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, value in on_device.items():
        by_dtype.setdefault(value.dtype, []).append(name)
    for names in by_dtype.values():
        flat = torch.cat([on_device[n].reshape(-1) for n in names]).cpu()
        for name, part in zip(names, flat.split([on_device[n].numel() for n in names])):
            out[name] = part.reshape(on_device[name].shape)
    return out
