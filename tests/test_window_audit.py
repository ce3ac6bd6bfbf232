"""Audit of the sliding windows against a definition written here (not `ops.window.reference`): random chains of
calls on one state, each call on a random backend and chunk, in float64; and the inference paths (the C decoding
loop, the banded continuation) on rows of one batch with different histories, as a padded generation makes them."""

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
