"""Device and dtype names as users write them (configs, CLI flags) → torch objects.

device  auto (CUDA when present, else CPU) | cpu | cuda | cuda:N
dtype   float32 | bfloat16 | float16  (also accepts a torch.dtype)
"""

from __future__ import annotations

import torch

from drelay_model.errors import DRelayError

DEVICE_NAMES = ("auto", "cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """`auto` → cuda if available else cpu; `cuda` without CUDA is a clear error."""
    if isinstance(name, torch.device):
        name = str(name)
    name = "auto" if name is None else name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base, _, index = name.partition(":")
    if base not in ("cpu", "cuda", "meta") or (index and not index.isdigit()):
        raise DRelayError(f"device must be one of {', '.join(DEVICE_NAMES)} or cuda:N, got '{name}'")
    if base == "cuda" and not torch.cuda.is_available():
        raise DRelayError(f"device '{name}' requested but CUDA is not available on this machine (use device=cpu or auto)")
    if base == "cuda" and index and int(index) >= torch.cuda.device_count():
        raise DRelayError(f"device '{name}' requested but only {torch.cuda.device_count()} CUDA device(s) exist")
    return torch.device(name)


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise DRelayError(f"dtype must be one of {', '.join(DTYPES)}, got '{name}'")
    return DTYPES[name]
