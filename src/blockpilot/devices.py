"""Resolving the user's `--device` choice ("auto", "cpu", "cuda", "cuda:N")."""

from __future__ import annotations

from blockpilot.errors import UserError


def resolve_device(name: str | None, flag: str = "--device") -> str:
    """`name` as a torch device string; "auto" or None pick CUDA when it is available, else CPU.

    Raises:
        UserError: CUDA was asked for but is not available, or the name is not a device.
    """
    import torch

    if name in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise UserError(f"{flag} {name}: not a device; use cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{flag} {name} but CUDA is not available; use {flag} cpu")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"{flag} {name}: only cpu and cuda are supported")
    return str(device)
