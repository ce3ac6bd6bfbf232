"""The decode state of the sliding-window methods: one tensor per call, [B, Hkv, size].

One flat row per KV head, so that a generation cache can slice, concatenate and reorder it along the batch like
OAL's state. It holds, in this order:

- slots [S + W, d + dv + 1]: rows 0..S-1 the sinks (the first S tokens), then W rows for the last W tokens at
  positions >= S, oldest first and right-aligned (row S + W - 1 is the newest token). A row is [k, v, 1]; an empty
  row is all zero, so its last column (the denominator's weight) says whether it is filled. Tokens that are sinks
  are never also in the window rows, so no key is counted twice.
- prefix [F, dv + 1] (oal-swa only, F = 1 + d + d(d+1)/2): OAL's state (`oal.ops`, Eq. 5) of every token that
  has left the window rows, i.e. of the keys S <= j <= i - W that query i reads through the kernel (the sinks
  never leave their rows, so they never enter it).

Its size, (S + W)(d + dv + 1) [+ F (dv + 1)], does not depend on the number of tokens seen.
"""

from __future__ import annotations

import torch

from oal.ops.kernel import feature_dim, key_features

__all__ = ["empty_window_state", "join_window_state", "sequence_state", "split_window_state", "window_state_size"]


def window_state_size(d: int, dv: int, window: int, sinks: int = 0, kernel: bool = False) -> int:
    """Entries of the state of one KV head."""
    return (sinks + window) * (d + dv + 1) + (feature_dim(d) * (dv + 1) if kernel else 0)


def split_window_state(state: torch.Tensor, d: int, dv: int, window: int, sinks: int = 0, kernel: bool = False):
    """Views (slots [B, Hkv, S + W, d + dv + 1], prefix [B, Hkv, F, dv + 1] or None) of a state [B, Hkv, size]."""
    n_slots = (sinks + window) * (d + dv + 1)
    slots = state[..., :n_slots].unflatten(-1, (sinks + window, d + dv + 1))
    prefix = state[..., n_slots:].unflatten(-1, (feature_dim(d), dv + 1)) if kernel else None
    return slots, prefix


def join_window_state(slots: torch.Tensor, prefix: torch.Tensor | None) -> torch.Tensor:
    parts = [slots.flatten(-2)] + ([prefix.flatten(-2)] if prefix is not None else [])
    return torch.cat(parts, dim=-1)


def empty_window_state(batch: int, n_kv: int, d: int, dv: int, window: int, sinks: int = 0, kernel: bool = False,
                       *, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """The state before the first token: every slot empty, zero prefix."""
    return torch.zeros(batch, n_kv, window_state_size(d, dv, window, sinks, kernel), dtype=dtype, device=device)


def sequence_state(k: torch.Tensor, v: torch.Tensor, window: int, sinks: int = 0, kernel: bool = False):
    """The state after a whole sequence k [B, Hkv, N, d], v [B, Hkv, N, dv], built from its definition."""
    bsz, n_kv, n, d = k.shape
    rows = torch.cat([k, v, torch.ones_like(v[..., :1])], dim=-1)
    slots = rows.new_zeros(bsz, n_kv, sinks + window, rows.shape[-1])
    slots[:, :, : min(sinks, n)] = rows[:, :, :sinks]  # the first S tokens
    last = rows[:, :, sinks:][:, :, max(n - sinks - window, 0):]  # the last W tokens after them
    slots[:, :, sinks + window - last.shape[2]:] = last
    prefix = None
    if kernel:  # Eq. 5 over the tokens older than the window that are not sinks
        old = rows[:, :, sinks : max(n - window, sinks)]
        prefix = key_features(old[..., :d]).transpose(-1, -2) @ old[..., d:]
    return join_window_state(slots, prefix)
