"""Small host values (token ids, positions, block tables, sequence bounds) put on the device
without waiting for it.

A plain copy from pageable host memory to a CUDA device waits until every kernel queued before
it has run: in the middle of a pass, the host then stops running ahead of the device, and the
device idles while the host launches the next kernels. Staged in pinned memory, the copy is
queued on the current stream like a kernel (torch keeps the staging memory until the copy has
run)."""
from __future__ import annotations

import torch


def upload(values, dtype: torch.dtype, device) -> torch.Tensor:
    """`values` (a list or tuple of numbers, or a tensor) as a `dtype` tensor on `device` (None:
    the CPU), from the host queued without a wait on CUDA (a tensor already on a device:
    `Tensor.to`'s own)."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    device = torch.device("cpu" if device is None else device)
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    _not_capturing()
    return host.pin_memory().to(device, non_blocking=True)


def upload_into(target: torch.Tensor, values) -> None:
    """target := `values` (a list or tuple of numbers, as many as `target` holds), from the host
    queued without a wait on CUDA."""
    host = torch.tensor(values, dtype=target.dtype)
    if not target.is_cuda:
        target.copy_(host)
        return
    _not_capturing()
    target.copy_(host.pin_memory(), non_blocking=True)


def _not_capturing() -> None:
    """A CUDA graph would keep the staging memory's address, which is freed once the copy has
    run: an upload is refused while the stream is captured (a plain copy fails there too)."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("host values cannot be uploaded while a CUDA graph is captured")
