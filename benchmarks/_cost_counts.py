"""The work of oal's code paths per operation, counted without running them on a GPU (see benchmarks.cost_model).

Measured: every aten op dispatched under `Counter` (FLOPs by FlopCounterMode's formulas, input + output bytes, one
launch), on meta-device modules (no memory, no time) or, where the code reads values, on small real CPU tensors.
Analytic: the attention cores FlopCounterMode cannot see (flash attention, the OAL Triton kernels).
"""

from __future__ import annotations

import functools
import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

N = 4096  # the paper's block length (App. F)


@functools.cache
def _rehearsal():
    """scripts/scale_rehearsal.py (not a package): its published configs and the paper's budget."""
    path = Path(__file__).resolve().parent.parent / "scripts" / "scale_rehearsal.py"
    spec = importlib.util.spec_from_file_location("scale_rehearsal", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# Llama-3.1-8B's config.json (meta-llama/Llama-3.1-8B): hidden 4096, 32 layers, 32 query / 8 KV heads, head_dim 128,
# intermediate 14336, vocabulary 128,256, untied embeddings.
LLAMA_8B = ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                          tie_word_embeddings=False, max_position_embeddings=131072))
GROUPS = {"qwen2.5-0.5b": 5, "llama-3.2-1b": 4, "llama-3.1-8b": 5}  # G per layer (paper Sec. 4.2: 2-5, 2-4; 8B: 5)



@dataclass(frozen=True)
class Op:
    flops: float
    bytes: float
    kind: str  # "bf16" | "fp32" (GEMM rate), "flash", "oal", "oal32" (analytic attention cores), "disk"
    launches: int = 1


class Counter(TorchDispatchMode):
    """Every aten op dispatched inside: an `Op` with its FLOPs (FlopCounterMode's formulas), input + output bytes
    and one launch. Views and detach move nothing and are skipped."""

    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if func.is_view or packet is torch.ops.aten.detach:
            return out
        flops = flop_registry[packet](*args, **kwargs, out_val=out) if packet in flop_registry else 0
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        half = any(t.dtype in (torch.bfloat16, torch.float16) for t in tensors)
        self.ops.append(Op(float(flops), float(nbytes), "bf16" if half else "fp32"))
        return out

    @property
    def flops(self) -> float:
        return sum(o.flops for o in self.ops)


class Saved:
    """Bytes autograd keeps for backward (unique storages; parameters excluded: they are resident anyway)."""

    def __init__(self, module: torch.nn.Module):
        self.skip = {p.untyped_storage()._cdata for p in module.parameters()}
        self.storages: dict[int, int] = {}

    def _pack(self, t):
        s = t.untyped_storage()
        if s._cdata not in self.skip:
            self.storages[s._cdata] = s.nbytes()
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def _stand_in_core(module, query, key, value, attention_mask, **kwargs):
    """The attention core's I/O only (reads q, k, v; writes o): its FLOPs are added analytically."""
    groups = query.shape[1] // key.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    return (query + k + v).transpose(1, 2).contiguous(), None


def shape_config(name: str, num_layers: int | None = 1):
    """The shape's transformers config, cut to `num_layers` decoder layers (None: the published count)."""
    from transformers import AutoConfig

    model_type, values = LLAMA_8B if name == "llama-3.1-8b" else _rehearsal().ARCHITECTURES[name]
    values = dict(values) if num_layers is None else {**values, "num_hidden_layers": num_layers}
    return AutoConfig.for_model(model_type, **values)


def meta_decoder(name: str, dtype=torch.bfloat16):
    """One-layer decoder of the shape on the meta device, attention core replaced by the stand-in."""
    from transformers import AttentionInterface, AutoModel
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("cost_stand_in", _stand_in_core)
    AttentionMaskInterface.register("cost_stand_in", lambda *args, **kwargs: None)  # causal inside the core
    with torch.device("meta"):
        model = AutoModel.from_config(shape_config(name), attn_implementation="cost_stand_in").to(dtype)
    return model.requires_grad_(False)


def _layer_call(model, batch: int, n: int, grad: bool):
    x = torch.zeros(batch, n, model.config.hidden_size, dtype=next(model.parameters()).dtype, device="meta")
    pos = torch.arange(n, device="meta")[None].expand(batch, -1)
    pe = model.rotary_emb(x, pos)
    return x.requires_grad_(grad), pos, pe


def layer_forward(model, batch: int, n: int) -> Counter:
    """The decoder layer's forward (no grad), measured op by op (RoPE tables included)."""
    x, pos, _ = _layer_call(model, batch, n, False)
    with torch.no_grad(), Counter() as c:
        pe = model.rotary_emb(x, pos)
        model.layers[0](x, attention_mask=None, position_ids=pos, position_embeddings=pe)
    return c


def with_lora(model, r: int = 8):
    """peft LoRA on q/k/v/o as `oal.adaptation.train.wrap_lora` configures it (AdaptConfig defaults)."""
    from peft import LoraConfig, inject_adapter_in_model

    from oal.adaptation.config import AdaptConfig

    cfg = AdaptConfig()
    with torch.device("meta"):
        return inject_adapter_in_model(LoraConfig(r=r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                                  target_modules=list(cfg.target_modules), bias="none"), model)


def layer_train(model, n: int) -> tuple[Counter, Counter, int]:
    """(forward, backward, saved bytes) of one LoRA-wrapped layer on one block with gradients."""
    x, pos, pe = _layer_call(model, 1, n, True)
    with Saved(model) as saved, Counter() as fwd:
        h = model.layers[0](x, attention_mask=None, position_ids=pos, position_embeddings=pe)
    h = h[0] if isinstance(h, tuple) else h
    with Counter() as bwd:
        h.backward(torch.ones_like(h))
    return fwd, bwd, saved.bytes


def head_chunk(cfg, grad: bool, tokens: int | None = None, dtype=torch.bfloat16) -> tuple[Counter, Counter | None,
                                                                                       int]:
    """(forward, backward, tokens) of one chunk of `oal.evaluate.loss.chunked_cross_entropy` on meta (`tokens`:
    the chunk's length, default the full chunk of `chunk_tokens`)."""
    from oal.evaluate.loss import _chunk_nll, chunk_tokens

    tokens = tokens or chunk_tokens(cfg.vocab_size)
    with torch.device("meta"):
        head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False).to(dtype).requires_grad_(False)
        h = torch.zeros(tokens, cfg.hidden_size, dtype=dtype).requires_grad_(grad)
        t = torch.zeros(tokens, dtype=torch.long)
    with Counter() as fwd:
        loss = _chunk_nll(head, h, t)
    if not grad:
        return fwd, None, tokens
    with Counter() as bwd:
        loss.backward()
    return fwd, bwd, tokens


# ----------------------------------------------------------------------------------------------- analytic cores

def _dims(cfg) -> tuple[int, int, int]:
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    return hq, hkv, getattr(cfg, "head_dim", None) or cfg.hidden_size // hq


def triton_rows(d: int) -> int:
    """State rows of one KV head in the Triton kernels' block layout (oal.ops.triton.kernels)."""
    nb = -(-d // 16)
    return 1 + 16 * nb + 256 * nb * (nb + 1) // 2


def oal_core(batch: int, n: int, hq: int, hkv: int, d: int, g: int, *, kind: str = "oal",
             backward: bool = False) -> Op:
    """The OAL Triton operator (analytic; see the module docstring). kind "oal32": fp32 inputs (tf32x3 dots). The
    forward of half inputs at d <= 64 runs 128-token chunks (oal.ops.triton.tiles.FWD_CHUNK), the backward 64."""
    rows, dv1, elem = triton_rows(d), d + 1, 4 if kind == "oal32" else 2

    def counts(chunk: int) -> tuple[float, float]:
        chunks = -(-n // chunk)
        flops = 2.0 * batch * n * (2 * hkv * rows * dv1 + hq * rows * dv1 + hq * chunk * ((g + 1) * d + dv1))
        # + the per-chunk states written and read: in the input's width (bf16 for half inputs), the normaliser 4 B
        # a row (fp32, or its two bf16 parts)
        io = batch * n * d * (2 * hq + 2 * hkv) * elem + 2 * batch * hkv * chunks * rows * (d * elem + 4)
        return flops, io

    if backward:
        flops, io = counts(64)
        return Op(2 * flops, 2 * io, kind, 3)
    flops, io = counts(128 if kind != "oal32" and d <= 64 else 64)
    return Op(flops, io, kind, 2)  # state scan + output kernels


def flash_core(batch: int, n: int, hq: int, hkv: int, d: int, *, backward: bool = False) -> Op:
    """Causal flash attention (SDPA), analytic: 2 N^2 d Hq forward (half the full 4 N^2 d Hq), 2.5x backward."""
    flops = 2.0 * batch * n * n * d * hq
    io = batch * n * d * (2 * hq + 2 * hkv) * 2
    return Op(2.5 * flops, 2 * io, "flash") if backward else Op(flops, io, "flash")


# ----------------------------------------------------------------------------------------------- real-tensor counts

def calibration_update(cfg, g: int, n: int = N, copies: int = 3) -> tuple[Counter, float]:
    """One update of one layer's calibration (all heads, `copies` initialisations), counted on real CPU fp32
    tensors of the layer's per-head shape: (ops, CPU seconds of that update, after one warm-up update). Query
    positions: 32, the last at n-1 (the worst case of the sampled prefix)."""
    from oal.calibration.loss import sampled_dense_output
    from oal.methods import build_method

    hq, hkv, d = _dims(cfg)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, hq, n, d, generator=gen)
    k, v = torch.randn(1, hkv, n, d, generator=gen), torch.randn(1, hkv, n, d, generator=gen)
    target = torch.randn(1, hq, 32, d, generator=gen)
    groups = (torch.rand(hq * copies, d, generator=gen) * g).long().clamp_max(g - 1)
    groups[:, 0] = g - 1  # the layer's group count is g
    method = build_method("oal", hq * copies, hkv * copies, d, groups=groups, n_groups=g, layer_idx=0)
    params = [p for p in method.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=0.02)
    pos = torch.cat([torch.randperm(n - 1, generator=gen)[:31].sort().values, torch.tensor([n - 1])])

    def update():
        pred = sampled_dense_output(method, q, k, v, pos, copies)
        loss = 0.5 * (pred - target.repeat(1, copies, 1, 1)).square().sum(dim=(0, 2, 3))
        opt.zero_grad(set_to_none=False)
        loss.sum().backward()
        with torch.no_grad():
            for p in params:  # per-head clip as calibration.fit._clip_and_mask does
                p.grad.mul_(torch.clamp(10.0 / (p.grad.flatten(1).norm(dim=1) + 1e-6), max=1.0).view(
                    -1, *([1] * (p.dim() - 1))))
        opt.step()

    update()  # warm-up: first-touch allocations and Adam's state are not an update's steady cost
    t0 = time.process_time()
    with Counter() as c:
        update()
    return c, time.process_time() - t0


def bootstrap_seconds(cfg, n_layers: int, n_bootstrap: int = 1000, prompts: int = 40) -> float:
    """CPU seconds of `stable_gap_groups` (B replicates) on random contribution scores of the layers' heads."""
    from oal.analysis.grouping import stable_gap_groups
    from oal.models.registry import PRESETS

    hq, _, d = _dims(cfg)
    p = PRESETS["default"]
    chi = torch.rand(n_layers, hq, prompts, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    t0 = time.process_time()
    stable_gap_groups(chi, tail_fraction=p["alpha"], min_support=p["gamma"], min_ratio=p["tau"],
                      min_groups=p["min_groups"], n_bootstrap=n_bootstrap)
    return time.process_time() - t0


