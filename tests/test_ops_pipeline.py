"""The chunked operator's block pipeline on single-threaded workers (`ops.workers`): exact, and never stuck.

The suite runs with one torch thread per xdist worker, where the pipeline is off; these tests set two threads.
"""

from __future__ import annotations

import threading

import pytest
import torch

import oal.ops.chunked as chunked
from oal.ops import oal_attention, workers
from oal.ops.chunked import chunked_attention

F64 = torch.float64


@pytest.fixture(autouse=True)
def two_threads(monkeypatch):
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(chunked, "BLOCK", 64)  # several blocks at small N
    monkeypatch.setattr(chunked, "NAN_SCRATCH", True)  # an unwritten scratch entry shows up as NaN
    monkeypatch.setattr(chunked, "DENSE_MAX", 0)  # no single dense chunk for short fresh sequences
    yield
    torch.set_num_threads(saved)


def make(b=2, hq=6, hkv=3, n=301, d=7, dv=5, g=3, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, dd, generator=gen, dtype=F64).to(dtype) * s
               for h, dd, s in ((hq, d, 0.5), (hkv, d, 0.5), (hkv, dv, 1.0)))
    groups = torch.randint(0, g, (hq, d), generator=gen)
    factor = torch.randn(hq, g + 1, g + 1, generator=gen, dtype=F64) * 0.5
    return q, k, v, groups, factor


def run(*args, pipeline: bool, monkeypatch, **kw):
    monkeypatch.setenv("OAL_CPU_PIPELINE", "1" if pipeline else "0")
    with torch.inference_mode():
        return oal_attention(*args, output_final_state=True, **kw)


# 5 blocks: one state chain; 2 blocks for 2 threads: the KV heads split into 2 chains (1 + 2 heads)
@pytest.mark.parametrize("hkv, n", [(1, 301), (3, 301), (3, 100)])
@pytest.mark.parametrize("with_state", [False, True])
def test_pipeline_matches_reference_fp64(monkeypatch, hkv, n, with_state):
    q, k, v, groups, factor = make(hkv=hkv, n=n)
    state = None
    if with_state:  # a state from an earlier segment: every chain starts from its own slice of it
        _, state = oal_attention(*make(hkv=hkv, n=37, seed=1)[:3], groups, factor, output_final_state=True)
    calls = []
    real = workers.Workers.run
    monkeypatch.setattr(workers.Workers, "run", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    out, final = run(q, k, v, groups, factor, initial_state=state, pipeline=True, monkeypatch=monkeypatch)
    assert calls, "the pipeline did not run"
    ref, ref_state = oal_attention(q, k, v, groups, factor, backend="reference", initial_state=state,
                                   output_final_state=True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(final, ref_state, rtol=1e-10, atol=1e-10)
    assert torch.get_num_threads() == 2  # restored after the run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pipeline_matches_serial_blocks(monkeypatch, dtype):
    args = make(n=450, d=16, dv=16, dtype=dtype)
    monkeypatch.setattr(chunked, "BLOCK", 128)  # bf16 chunks are 64 tokens
    out, state = run(*args, pipeline=True, monkeypatch=monkeypatch)
    want, want_state = run(*args, pipeline=False, monkeypatch=monkeypatch)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-4)


def test_raw_numerator_matches_serial(monkeypatch):
    """The sliding-window hybrid's raw mode (the numerator, denominator last) through the pipeline."""
    q, k, v, groups, factor = make(n=200)
    v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    from oal.ops.kernel import cached_coefficients

    coeffs, _ = cached_coefficients(factor, groups, 1e-6, 0.4)
    state = torch.zeros(2, 3, 1 + 7 + 28, v.shape[-1], dtype=F64)
    outs = []
    for on in ("1", "0"):
        monkeypatch.setenv("OAL_CPU_PIPELINE", on)
        with torch.no_grad():
            outs.append(chunked_attention(q, k, v, groups, factor, coeffs, eps=1e-6, scale=0.4, causal=True,
                                          state=state, raw=True))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-12, atol=1e-12)


def test_gradients_take_the_serial_path_and_match_reference(monkeypatch):
    q, k, v, groups, factor = make(n=150)
    for t in (q, k, v, factor):
        t.requires_grad_(True)
    monkeypatch.setattr(workers.Workers, "run", lambda *a, **kw: pytest.fail("pipeline used under autograd"))
    out = oal_attention(q, k, v, groups, factor)
    ref = oal_attention(q, k, v, groups, factor, backend="reference")
    w = torch.randn_like(out)
    got = torch.autograd.grad((out * w).sum(), (q, k, v, factor))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v, factor))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_a_failing_item_raises_and_releases_the_waiting_ones():
    pool = workers.workers(2)
    chain = workers.Chain({0: 0})
    started = threading.Event()

    def item(i):
        if i == 0:
            started.wait(5)
            raise ValueError("block 0 broke")
        started.set()
        chain.take(i)  # waits for block 0's value, which never comes

    with pytest.raises(ValueError, match="block 0 broke"):
        pool.run(item, [(0,), (1,)], chain)
    assert torch.get_num_threads() == 2
    pool.run(lambda: None, [()])  # the pool still works


def test_pool_is_rebuilt_for_a_new_size_or_after_a_fork():
    a = workers.workers(2)
    assert workers.workers(2) is a
    a.pid = -1  # as if this process were a fork of the one that started the threads
    b = workers.workers(2)
    assert b is not a and workers.workers(3).size == 3
