"""`oal demo`: the operator on random inputs, checked against the dense reference."""

from __future__ import annotations

import time

import torch
import typer
from rich.console import Console
from rich.table import Table

from oal.cli.app import app
from oal.cli.options import DeviceOpt, Max, dtype_choice
from oal.ops import oal_attention
from oal.ops.kernel import perturbed_factor, taylor_factor


@app.command()
def demo(
    length: int = typer.Option(1024, min=1, max=2**31 - 1, help="Sequence length N (memory checked below)."),
    heads: int = typer.Option(4, min=1, max=Max.HEADS, help="Query heads Hq."),
    kv_heads: int = typer.Option(2, min=1, max=Max.HEADS, help="Key/value heads Hkv."),
    head_dim: int = typer.Option(64, min=1, max=Max.DIM, help="Head dimension d (= dv)."),
    n_groups: int = typer.Option(3, min=1, max=Max.DIM,
                                 help="Groups G per head, at most --head-dim (each dimension is in "
                                 "one)."),
    seed: int = typer.Option(0, min=0, max=Max.SEED, help="Random seed."),
    device: DeviceOpt = "auto",
    dtype: str = typer.Option("float32", callback=dtype_choice, help="dtype of the random q, k and v: float32, "
                              "bfloat16 or float16 (the kernel's factor stays float32)."),
) -> None:
    """Run every backend of the OAL operator on random inputs and compare it with the dense reference."""
    if heads % kv_heads:
        raise typer.BadParameter(f"must divide --heads={heads}", param_hint="--kv-heads")
    if n_groups > head_dim:  # every dimension has one group id: more groups than dims leave some groups empty
        raise typer.BadParameter(f"expected at most --head-dim={head_dim} groups (each of the d dimensions belongs "
                                 f"to one group), got {n_groups}", param_hint="--n-groups")
    need, have = _bytes_needed(length, heads, kv_heads, head_dim, n_groups, dtype), _available_bytes(device)
    if have is not None and need > have:
        raise typer.BadParameter(f"N={length}, d={head_dim} need about {need / 2**30:.3g} GiB (the dense reference "
                                 f"holds an N x N score matrix per head, the kernel's state (1 + d + d(d+1)/2) x "
                                 f"(d + 1) numbers per KV head), more than the {have / 2**30:.3g} GiB available on "
                                 f"{device}; use a smaller --length or --head-dim", param_hint="--length")
    gen = torch.Generator().manual_seed(seed)
    # inputs in --dtype on --device (as a converted model's q/k/v); the factor stays float32 (oal.device)
    q, k, v = (torch.randn(1, h, length, head_dim, generator=gen).to(device, getattr(torch, dtype))
               for h in (heads, kv_heads, kv_heads))
    groups = torch.randint(0, n_groups, (heads, head_dim), generator=gen).to(device)
    factor = perturbed_factor(taylor_factor(heads, n_groups), 0.1, generator=gen).to(device)
    table = Table(title=f"OAL operator, N={length}, Hq={heads}, Hkv={kv_heads}, d={head_dim}, G={n_groups}, "
                  f"{dtype} on {device}")
    for col in ("backend", "time (ms)", "max |out - reference|"):
        table.add_column(col, justify="right")
    ref, (backends, skipped) = None, _backends(q, v)
    for backend in backends:
        # a first, untimed call: it builds the CPU kernel, starts the workers, compiles and tunes Triton (the time
        # column measured that, not the backend); the dense reference has no such set-up: a short prefix warms it
        n = 64 if backend == "reference" else length
        _timed(lambda b=backend, n=n: oal_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], groups, factor, backend=b))
        out, ms = _timed(lambda b=backend: oal_attention(q, k, v, groups, factor, backend=b))
        ref = out if ref is None else ref
        table.add_row(backend, f"{ms:.1f}", f"{(out.float() - ref.float()).abs().max().item():.2e}")
    table.caption = "; ".join(skipped) or None
    Console().print(table)


def _timed(call) -> tuple[torch.Tensor, float]:
    """call()'s result and its wall time in ms (on CUDA, up to the end of its kernels)."""
    t0 = time.perf_counter()
    out = call()
    if out.is_cuda:
        torch.cuda.synchronize()
    return out, 1e3 * (time.perf_counter() - t0)


def _backends(q: torch.Tensor, v: torch.Tensor) -> tuple[list[str], list[str]]:
    """The backends the demo runs on these inputs, and a note for each it leaves out (the table said nothing)."""
    from oal.ops import triton

    length, run, skipped = q.shape[2], ["reference", "chunked"], []
    if length <= 4096:
        run.append("recurrent")
    else:
        skipped.append(f"recurrent not run: the token loop is slow beyond N=4096 (N={length})")
    if q.is_cuda:
        why = triton.unsupported(q, v) if triton.available() else triton.INSTALL_HINT
        run += [] if why else ["triton"]
        skipped += [f"triton not run: {why}"] if why else []
    return run, skipped


def _bytes_needed(n: int, heads: int, kv_heads: int, d: int, groups: int, dtype: str) -> int:
    """Peak memory of the demo: q/k/v and their float32 (float64) copies, two outputs, and the dense reference's
    largest step, per head: einsum's q_r k_r for every pair [N, N, d], the scores s [N, N, G] and s_bar [N, N, G + 1],
    kappa and its masked copy, the mask (measured: within 10% of the peak RSS at N = 2048 and 4096); and two
    states of the kernel per KV head, (1 + d + d(d+1)/2) x (d + 1) numbers each (the running state and one chunk's:
    a lower bound, which decides at large d: 138 GB at d = 1024 with 64 KV heads)."""
    size = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    work = 8 if dtype == "float64" else 4
    inputs = (heads + 2 * kv_heads) * n * d * (size + work)
    states = 2 * kv_heads * (1 + d + d * (d + 1) // 2) * (d + 1) * work
    return inputs + 2 * heads * n * d * size + n * n * ((d + 2 * groups + 3) * work + 1) + states


def _available_bytes(device: str) -> int | None:
    """Free memory of `device` (CUDA: the driver's count; CPU: MemAvailable of /proc/meminfo), None if unknown."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
