"""Generation cache for converted layers: an O(1) recurrent state instead of a growing K/V cache.

Design: a converted layer's slot of the ordinary transformers `Cache` (e.g. the `DynamicCache` that `generate`
creates) is replaced, on first use, by an `OALStateLayer` (see `models.convert`, which does the swap from a
forward pre-hook of the attention module). Softmax layers keep their `DynamicLayer` K/V cache untouched, so
`past_key_values.get_seq_length()` and the mask sizes stay those of a normal cache.

`OALStateLayer.update(k, v)` only counts tokens and hands the new k/v back; the attention function then runs the
method with `initial_state=layer.state, output_final_state=True` and stores the new state
[B, Hkv, 1 + d + d(d+1)/2, dv + 1] (OAL's: H0, H1, packed H2 and the denominator column, see `oal.ops`; the
sliding windows' is one flat [B, Hkv, size], `oal.ops.window.state`). Its size does not depend on the context length.

A state the operator returned is the cache's own (`OALStateLayer.keep`, `owned`): the attention function hands it
back under `oal.ops.checks.cache_owned`, so the operator neither checks it again nor copies it (it updates it in
place). A state put into `layer.state` from outside is not owned, and is checked like any caller's.

Methods without a recurrent state (`supports_state = False`: softmax, kernels without a prefix state) in a
converted layer get `OALStateLayer(stateful=False)`, which stores K/V like a dynamic layer; decoding then
recomputes the dense kernel of the new queries against all cached keys (exact, O(N) per token, not O(1)).

Beam search (`reorder_cache`, `batch_select_indices`, `batch_repeat_interleave`) is supported; `crop` (assisted
decoding) is not, because a summed state cannot forget tokens. An offloaded cache keeps the states on their device
(only stateless layers' K/V go to the CPU).
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers.cache_utils import CacheLayerMixin

__all__ = ["OALStateLayer", "cache_kwargs", "state_nbytes"]


def cache_kwargs(model, cache) -> dict:
    """The keyword argument that hands `cache` to `model`'s forward: `cache` in the transformers releases that renamed
    it, `past_key_values` before (5.17 on the lent GPU machine; 5.25 still takes it, with a deprecation warning).
    Each release ignores the other's name without a word: the model then makes a cache of its own and the caller's
    stays empty."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model forwards **kwargs
    return {_cache_keyword(type(base)): cache}


@functools.cache
def _cache_keyword(model_class: type) -> str:
    """Read once per model class: decoding loops call `cache_kwargs` on every step, some inside their timers."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


class OALStateLayer(CacheLayerMixin):
    """Cache slot of one converted layer: the recurrent state (or K/V for stateless methods) and a token count."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, stateful: bool = True, **kwargs):
        super().__init__()
        self.stateful = stateful
        self._state: torch.Tensor | None = None
        self.owned = False  # whether the state is one the operator returned, held by nobody else
        self.seen = 0
        # [B] bool, rows that have had no real token yet (a chunked prefill's left padding; their state rows are
        # placeholders), or None when every row has one
        self.fresh: torch.Tensor | None = None

    def __repr__(self):
        return f"OALStateLayer(stateful={self.stateful}, seen={self.seen})"

    @property
    def state(self) -> torch.Tensor | None:
        return self._state

    @state.setter
    def state(self, value: torch.Tensor | None) -> None:  # from outside: checked again by the operator
        self._state, self.owned = value, False

    def keep(self, state: torch.Tensor | None) -> None:
        """Store the state the operator returned (the attention function does): the cache's own from now on."""
        self._state, self.owned = state, state is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        if not self.stateful:
            self.keys = key_states[..., :0, :]
            self.values = value_states[..., :0, :]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Count the new tokens; stateful: return them unchanged (the state is updated by the attention function)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        if self.stateful:
            return key_states, value_states
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        # the same (kv_length, kv_offset) a dynamic layer reports: masks cover every token seen so far; transformers
        # 5.0-5.3 (not 5.8) pass the cache_position tensor instead of the query length
        if torch.is_tensor(query_length):
            query_length = query_length.shape[0]
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # get_max_length's name, abstract, in transformers 5.0-5.12 (not 5.17)
        return -1

    def reset(self) -> None:
        self.state, self.keys, self.values, self.fresh = None, None, None, None
        self.seen = 0
        self.is_initialized = False

    def _map_batch(self, fn) -> None:
        if self._state is not None:  # a new tensor made from the cache's own: still its own
            self._state = fn(self._state)
        if not self.stateful and self.keys is not None:
            self.keys, self.values = fn(self.keys), fn(self.values)
        if self.fresh is not None:
            self.fresh = fn(self.fresh)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise ValueError("crop: a converted layer keeps a summed recurrent state and cannot drop tokens "
                             "(assisted/speculative decoding is not supported)")

    def offload(self):
        # an offloaded cache (generate(cache_implementation="offloaded")) offloads a layer right after `update`, but
        # a state is read after it (by the attention function): moved to the CPU there, the next token failed on
        # CUDA. A state's size does not grow with the context, so it stays on its device; K/V are offloaded
        if not self.stateful:
            self._map_batch(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.is_initialized and not self.stateful:
            self._map_batch(lambda t: t.to(self.device, non_blocking=True))


def state_nbytes(cache) -> dict[int, int]:
    """Bytes held per layer of a cache: recurrent state for converted layers, K/V for the others."""
    out = {}
    for i, layer in enumerate(cache.layers):
        tensors = [getattr(layer, "state", None), getattr(layer, "keys", None), getattr(layer, "values", None)]
        out[i] = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return out
