"""Audit of the sliding windows against a definition written here (not `ops.window.reference`): random chains of
calls on one state, each call on a random backend and chunk, in float64; and the inference paths (the C decoding
loop, the banded continuation) on rows of one batch with different histories, as a padded generation makes them.
Through a converted HF model: an offloaded cache, prefill / continuation split points around the window and the
sinks, and a multi-token continuation of a left-padded batch, against one forward."""

from __future__ import annotations

import math
import random

import pytest
import torch

from oal.ops import cpu_kernel
from oal.ops.kernel import perturbed_factor, taylor_factor
from oal.ops.window import window_attention

F64 = torch.float64


def definition(q, k, v, window, sinks, groups=None, factor=None, eps=1e-6):
    """y_i = (sum_{exact} e^{s_ij} v_j + sum_{older} kappa_ij v_j) / (same with v = 1), exact = {i - W < j <= i} u
    {j < S, j <= i}, older = {S <= j <= i - W} (oal-swa; swa drops them), kappa = eps + |L^T s_bar|^2 (Eq. 7)."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scale = 1 / math.sqrt(q.shape[-1])
    n = q.shape[2]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    exact = (j <= i) & ((j > i - window) | (j < sinks))
    older = (j <= i - window) & (j >= sinks)
    w = torch.exp(scale * q @ k.transpose(-1, -2)) * exact
    if groups is not None:
        onehot = torch.nn.functional.one_hot(groups.long(), factor.shape[-1] - 1).to(F64)  # [Hq, d, G]
        s = torch.einsum("bhir,bhjr,hrg->bhijg", q * scale, k, onehot)
        s_bar = torch.cat([torch.ones_like(s[..., :1]), s], -1)
        kappa = eps + torch.einsum("bhijg,hgf->bhijf", s_bar, torch.tril(factor.double())).pow(2).sum(-1)
        w = w + kappa * older
    return (w @ v) / w.sum(-1, keepdim=True)


def _inputs(b, hq, hkv, n, d, dv, g, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, dd, generator=gen, dtype=F64) for h, dd in ((hq, d), (hkv, d), (hkv, dv)))
    groups = torch.randint(0, g, (hq, d), generator=gen)
    factor = perturbed_factor(taylor_factor(hq, g, dtype=F64), 0.5, generator=gen)
    return q, k, v, groups, factor


def test_random_chains_of_calls_match_the_definition():
    rnd = random.Random(0)
    for trial in range(24):
        window, sinks, n = rnd.choice([1, 2, 3, 5, 8]), rnd.choice([0, 1, 2, 5]), rnd.randint(1, 30)
        q, k, v, groups, factor = _inputs(2, 4, 2, n, 4, 3, 2, trial)
        kw = dict(window=window, sinks=sinks)
        if trial % 3:
            kw.update(groups=groups, factor=factor)
        want = definition(q, k, v, window, sinks, kw.get("groups"), kw.get("factor"))
        outs, state, start = [], None, 0
        while start < n:
            stop = min(n, start + rnd.randint(1, 7))
            sl = slice(start, stop)
            out, state = window_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], initial_state=state,
                                          output_final_state=True, backend=rnd.choice(["banded", "recurrent", "auto"]),
                                          chunk_size=rnd.choice([None, 1, 3]), **kw)
            outs.append(out)
            start = stop
        torch.testing.assert_close(torch.cat(outs, 2), want, rtol=0, atol=1e-12, msg=f"trial {trial}: {kw}")


@pytest.mark.parametrize("kernel", [False, True], ids=["swa", "oal-swa"])
def test_inference_paths_on_rows_with_different_histories(monkeypatch, kernel):
    """fp32 without autograd (the C token loop, the banded continuation): rows prefilled alone with 0..30 tokens
    (sinks and window empty, filling, full), concatenated, then decoded together one token at a time and in chunks
    of 7; each row equals the definition of its own sequence."""
    window, sinks, lens, steps = 6, 3, (0, 1, 2, 5, 19, 30), 19
    _, _, _, groups, factor = _inputs(1, 4, 2, 1, 16, 8, 3, 99)
    seqs = [_inputs(1, 4, 2, n + steps, 16, 8, 3, n)[:3] for n in lens]
    kw = dict(window=window, sinks=sinks)
    if kernel:
        kw.update(groups=groups, factor=factor.float())
    calls = []
    real = cpu_kernel.window_decode
    monkeypatch.setattr(cpu_kernel, "window_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        state = torch.cat([window_attention(*(t[:, :, :n].float() for t in s), output_final_state=True, **kw)[1]
                           for s, n in zip(seqs, lens, strict=True)])
        outs, t = [], 0
        for size in [1] * 12 + [7]:
            new = [torch.cat([s[x][:, :, n + t : n + t + size] for s, n in zip(seqs, lens, strict=True)]).float()
                   for x in range(3)]
            out, state = window_attention(*new, initial_state=state, output_final_state=True, **kw)
            outs.append(out)
            t += size
    got = torch.cat(outs, 2).double()
    for b, (s, n) in enumerate(zip(seqs, lens, strict=True)):
        want = definition(*s, window, sinks, groups if kernel else None, factor)[:, :, n:]
        torch.testing.assert_close(got[b : b + 1], want, rtol=0, atol=2e-6, msg=f"row {b} (prefill {n})")
    assert calls or not cpu_kernel.available()  # the C loop served the single tokens where it is built


class _NoStream:
    """CUDA's stream calls in transformers' offloaded cache, answered on a CPU (nothing to wait for)."""

    def wait_stream(self, other):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_an_offloaded_cache_keeps_the_window_state_on_the_device(monkeypatch):
    """generate(cache_implementation="offloaded") (a DynamicCache(offloading=True)) offloads each layer to the CPU
    right after its `update`, and a converted layer's attention reads its state after that: the state left for the
    CPU beside CUDA queries and the second token failed ("initial_state: expected a tensor on q's device"). On the
    fake device (tests/_fake_device.py), CUDA's streams stubbed: the tokens of the model on the CPU, the softmax
    layer's K/V offloaded and the window states still on the device."""
    import copy

    from _fake_device import FAKE, fake_device, is_fake
    from test_decode import _ids
    from test_window_models import _model
    from transformers import DynamicCache

    from oal.models.cache import cache_kwargs

    model = _model("oal-swa", layers=(0, 1)).float()
    ids = _ids(2, 9) % 52 + 1
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **kw)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: _NoStream())
    # the cache makes its stream with torch.Stream(): on a CUDA build without a GPU (the GPU machine's twin) that
    # fails, so a stub stands in from the start
    monkeypatch.setattr(torch, "Stream", lambda *args, **kwargs: _NoStream())
    with fake_device():
        on_device = copy.deepcopy(model).to(FAKE)
        cache = DynamicCache(config=on_device.config, offloading=True)
        cache.prefetch_stream = _NoStream()
        got = on_device.generate(ids.to(FAKE), **cache_kwargs(on_device, cache), **kw)
        assert torch.equal(got.cpu(), want)
        assert not is_fake(cache.layers[2].keys)  # transformers did offload: the softmax layer's K/V
        assert is_fake(cache.layers[0].state) and is_fake(cache.layers[1].state)


def _hf_model(name, window, sinks, layers=(0, 1)):
    """A tiny float64 Qwen2 (test_decode's shape) with seeded window methods, the hybrids' factors off their start."""
    from test_decode import HKV, HQ, D, V
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from oal.methods import build_method
    from oal.models.convert import convert

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=V, hidden_size=HQ * D, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=HQ, num_key_value_heads=HKV, max_position_embeddings=128)
    gen = torch.Generator().manual_seed(3)
    methods = {}
    for i in layers:
        kw = {"groups": torch.randint(0, 3, (HQ, D), generator=gen), "n_groups": 3} if name == "oal-swa" else {}
        methods[i] = build_method(name, HQ, HKV, D, window=window, sinks=sinks, layer_idx=i, **kw)
        with torch.no_grad():
            for p in methods[i].parameters():
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return convert(Qwen2ForCausalLM(cfg).double().eval(), list(layers), methods)


@pytest.mark.parametrize("name", ["oal-swa", "swa"])
def test_split_points_around_the_window_and_sinks(name):
    """A prefill of A tokens, a continuation of B tokens in one call, then single tokens, for A below the sinks, at
    the window, at W + S - 1, W + S, W + S + 1, and B crossing those boundaries: every position's logits are those
    of one forward (float64)."""
    from test_decode import _ids
    from test_window_models import _in_chunks

    window, sinks = 4, 3
    model = _hf_model(name, window, sinks)
    ids = _ids(2, 16, seed=7)
    with torch.no_grad():
        full = model(ids).logits
    for a, b in [(1, 2), (2, 5), (4, 1), (4, 4), (6, 2), (6, 7), (7, 1), (8, 3), (5, 9)]:
        got, _ = _in_chunks(model, ids, [a, b] + [1] * (16 - a - b))
        torch.testing.assert_close(got, full, rtol=1e-9, atol=1e-10, msg=f"prefill {a}, then {b}")


def test_multi_token_continuation_of_a_left_padded_batch():
    """Rows prefilled with 14, 1, 5 and 2 real tokens (left padding longer than the window, a row of one token:
    sinks and window at different fills), then 4 tokens in one call and single tokens: each row's logits are those
    of the row run alone (float64)."""
    from transformers import DynamicCache

    from oal.models.cache import cache_kwargs

    model = _hf_model("oal-swa", 3, 2)
    lengths, width, more = (14, 1, 5, 2), 14, 6
    rows = [torch.randint(1, 53, (1, n + more), generator=torch.Generator().manual_seed(s)) for s, n in
            enumerate(lengths)]
    batch = torch.cat([torch.nn.functional.pad(r[:, :-more], (width - r.shape[1] + more, 0)) for r in rows])
    mask = (torch.arange(width)[None] >= width - torch.tensor(lengths)[:, None]).long()
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        parts = [model(batch, attention_mask=mask, position_ids=pos, **cache_kwargs(model, cache)).logits]
        start = 0
        for size in (4, 1, 1):
            new = torch.cat([r[:, r.shape[1] - more + start : r.shape[1] - more + start + size] for r in rows])
            mask = torch.cat([mask, torch.ones(len(rows), size, dtype=mask.dtype)], 1)
            at = pos[:, -1:] + 1 + torch.arange(size)[None]
            parts.append(model(new, attention_mask=mask, position_ids=at, **cache_kwargs(model, cache)).logits)
            pos = torch.cat([pos, at], 1)
            start += size
        got = torch.cat(parts, 1)
        for b, (r, n) in enumerate(zip(rows, lengths, strict=True)):
            torch.testing.assert_close(got[b, width - n :], model(r).logits[0], rtol=1e-9, atol=1e-10, msg=f"row {b}")
