"""What the paper's protocol costs on one H200 or one A100-80GB: time and peak memory per stage, before renting one.

A roofline composition, nothing here runs on a GPU. Per shape (Qwen2.5-0.5B, Llama-3.2-1B and a Llama-3.1-8B
shape, head_dim 128) and per operation of the code paths oal runs, the work is counted:

- measured here (meta device, no memory, no time): every aten op of the HF decoder layer's forward, of its
  forward + backward with peft LoRA r=8 on q/k/v/o (backbone frozen), of one chunk of the chunked LM head +
  cross-entropy (`oal.evaluate.loss`), under a dispatch mode that records per op the FLOPs (torch's
  FlopCounterMode formulas, `flop_registry`), the bytes of its inputs and outputs (unfused eager traffic) and one
  launch; the tensors autograd saves for backward (saved-tensor hooks, parameters excluded);
- measured here (small real CPU tensors, counted the same way): one calibration update of a whole layer
  (`oal.calibration.loss.sampled_dense_output` for all heads x 3 initialisations at once, as `calibration.fit`
  batches them, + loss, backward, clip, Adam), and the grouping bootstrap (`oal.analysis.stable_gap_groups`,
  B = 1000; it runs on the CPU in float64 on any device, so its CPU seconds here are its cost);
- analytic (FlopCounterMode cannot see Triton kernels or flash attention): the attention core. Softmax: causal
  flash attention, 2 N^2 d Hq FLOPs forward (half of the full 4 N^2 d Hq), 2.5x that backward. OAL (the Triton
  kernels of `oal.ops.triton`): state rows R = 1 + D16 + 256 NB(NB+1)/2 per KV head (d padded to D16 = 16 NB,
  16 x 16 block pairs), chunks C of 64 (128 in the forward of half inputs at d <= 64); forward = state scan
  (2 N Hkv R (dv+1), twice: two passes) + readout (2 N Hq R (dv+1)) + intra-chunk Eq. 7 (2 N Hq C ((G+1) d + dv +
  1)); backward 2x forward at C = 64; HBM traffic q/k/v/o
  + the per-chunk states written and read (bf16 for bf16 inputs, their normaliser 4 B a row). The decoder layer is
  measured with a stand-in core that only reads q/k/v and writes o, and the analytic core is added.

Time per op = max(FLOPs / (peak x efficiency), bytes / (HBM bandwidth x fraction), launches x latency), summed over
ops, layers, updates and blocks. The assumptions (peaks with their sources, MFU, bandwidth fraction, launch latency,
the OAL kernel's efficiency, token lengths, chars/token) are printed under the table and written to the JSON.
Peak memory per stage = weights (bf16) + what the stage keeps (LoRA params, grads, AdamW states; activations saved
for backward at N = 4096: no layer checkpointing on CUDA, as `oal.device.checkpoint_layers` decides; the captured
calibration data of one layer in fp32) + its largest transient (one op's working set, the logits chunk).

Writes `--json` (default benchmarks/results/cost_model.json) and a PNG beside it, and prints the table with the
assumptions under it, then the CPU cross-checks: one Qwen-shaped layer forward at N = 4096 timed on this CPU
against its GEMM rate (are the counts right?), the adaptation step's memory against benchmarks.memory, the
calibration update's CPU seconds, and scripts/scale_rehearsal.py's result where /tmp/rehearsal-qwen has one.

    python -m benchmarks.cost_model
    python -m benchmarks.cost_model --json /tmp/cost.json --no-cpu-check
"""

# ruff: noqa: E402  (the arguments are parsed before the heavy imports)
from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks._common import ToolParser, list_of, output_file, run_tool

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE_NAMES = ("qwen2.5-0.5b", "llama-3.2-1b", "llama-3.1-8b")
GPU_NAMES = ("H200", "A100")
OUTPUTS = ("the JSON of the composition (--json; default benchmarks/results/cost_model.json) and a PNG beside it; the "
           "table, its assumptions and the CPU cross-checks on stdout")


def _name_in(names: tuple[str, ...]):
    def parse(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(f"expected names of {', '.join(names)}, got {text!r}")
        return text
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    parser = ToolParser(__doc__, OUTPUTS)
    parser.add_argument("--json", type=output_file, default=RESULTS / "cost_model.json",
                        help="write the result here, and a PNG beside it (default: benchmarks/results/)")
    parser.add_argument("--shapes", type=list_of(_name_in(SHAPE_NAMES)), default=",".join(SHAPE_NAMES),
                        help="comma-separated, of " + ", ".join(SHAPE_NAMES))
    parser.add_argument("--gpus", type=list_of(_name_in(GPU_NAMES)), default=",".join(GPU_NAMES),
                        help="comma-separated, of " + ", ".join(GPU_NAMES))
    parser.add_argument("--no-cpu-check", action="store_true",
                        help="skip the CPU cross-checks (about half a CPU minute)")
    return parser.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None  # before the heavy imports: --help and bad input at once

import math
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from benchmarks._cost_counts import (
    GROUPS,
    Counter,
    N,
    Op,
    _dims,
    _rehearsal,
    bootstrap_seconds,
    calibration_update,
    flash_core,
    head_chunk,
    layer_forward,
    layer_train,
    meta_decoder,
    oal_core,
    shape_config,
    triton_rows,
    with_lora,
)


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float  # dense tensor-core peak
    fp32_tflops: float  # non-tensor-core FP32 (torch's fp32 matmuls: TF32 is off by default)
    tf32_tflops: float  # dense TF32 tensor-core peak (the Triton kernel's fp32 dots run as tf32x3: a third)
    hbm_tbs: float
    memory_gb: float


# Peaks from NVIDIA's datasheets (dense: the "with sparsity" figures halved). H200 SXM: 989 TFLOPS BF16, 67 TFLOPS
# FP32, 494 TFLOPS TF32, 4.8 TB/s HBM3e, 141 GB (nvidia.com/en-us/data-center/h200). A100 80GB SXM: 312 TFLOPS BF16,
# 19.5 TFLOPS FP32, 156 TFLOPS TF32, 2,039 GB/s HBM2e, 80 GB (NVIDIA A100 datasheet).
GPUS = {"H200": GPU("H200 SXM 141GB", 989.0, 67.0, 494.0, 4.8, 141.0),
        "A100": GPU("A100-80GB SXM", 312.0, 19.5, 156.0, 2.039, 80.0)}
assert tuple(GPUS) == GPU_NAMES  # --gpus' choices, named before the imports


@dataclass
class Assumptions:
    mfu: float = 0.40  # achieved fraction of peak for GEMMs (Llama 3 report: 38-43% BF16 MFU on H100; PaLM 46%)
    bandwidth_fraction: float = 0.70  # of HBM peak for memory-bound eager ops (STREAM-like copies reach ~85-90%)
    launch_us: float = 8.0  # per dispatched op: CUDA launch + PyTorch eager dispatch (a floor for small ops)
    flash_efficiency: float = 0.40  # causal flash attention (SDPA): of the bf16 peak
    oal_efficiency: float = 0.10  # OAL Triton kernels: NEVER RUN ON A GPU, no measured number: pessimistic guess
    oal_efficiency_range: tuple[float, float] = (0.03, 0.30)  # the totals are also given at these
    disk_gbs: float = 2.0  # NVMe write/read of the calibration capture (DIR/.oal/capture)
    host_cpu_factor: float = 1.0  # GPU host CPU vs this CPU for the CPU-side bootstrap (1: as fast as here)
    chars_per_token: float = 4.5  # WikiText-103 test with a 128k-150k BPE (GPT-2's BPE gives ~4.5 on it)
    zeroshot_tokens: dict = field(default_factory=lambda: {  # (context, continuation) tokens per choice, assumed
        "piqa": (14, 26), "hellaswag": (52, 26), "arc_easy": (30, 6)})
    zeroshot_batch: int = 8  # oal.evaluate.zeroshot's default


ZEROSHOT = {"piqa": (1838, 2), "hellaswag": (10042, 4), "arc_easy": (2376, 4)}  # examples x choices (App. F.3)
ARMS = ("oal", "global", "softmax")  # oal.pipeline.config.DEFAULT_METHODS: what `oal run` runs by default



def op_seconds(op: Op, gpu: GPU, a: Assumptions) -> float:
    """Roofline time of one op: the slowest of compute, memory traffic and launch latency."""
    rate = {"bf16": gpu.bf16_tflops * a.mfu, "fp32": gpu.fp32_tflops * a.mfu,
            "flash": gpu.bf16_tflops * a.flash_efficiency, "oal": gpu.bf16_tflops * a.oal_efficiency,
            "oal32": gpu.tf32_tflops / 3 * a.oal_efficiency, "disk": math.inf}[op.kind] * 1e12
    bw = a.disk_gbs * 1e9 if op.kind == "disk" else gpu.hbm_tbs * 1e12 * a.bandwidth_fraction
    return max(op.flops / rate, op.bytes / bw, op.launches * a.launch_us * 1e-6)


def seconds(ops: list[Op], gpu: GPU, a: Assumptions) -> float:
    return sum(op_seconds(op, gpu, a) for op in ops)


# ----------------------------------------------------------------------------------------------- stages

@dataclass
class Part:
    """`count` repetitions of `ops` (one named piece of a stage's work)."""

    name: str
    ops: list[Op]
    count: float
    source: str  # "measured (meta)", "measured (CPU tensors)", "analytic"


@dataclass
class Stage:
    name: str
    parts: list[Part]
    memory: dict[str, float]  # component -> bytes resident at the stage's peak
    cpu_seconds: float = 0.0  # work that runs on the host CPU whatever the device (the grouping bootstrap)

    def seconds(self, gpu: GPU, a: Assumptions) -> float:
        return sum(p.count * seconds(p.ops, gpu, a) for p in self.parts) + self.cpu_seconds * a.host_cpu_factor

    @property
    def peak_bytes(self) -> float:
        return sum(self.memory.values())


def _peak_op(ops: list[Op]) -> float:
    return max((o.bytes for o in ops), default=0.0)


class Shape:
    """One model shape's measured per-layer pieces, and its stages composed from them."""

    def __init__(self, name: str, a: Assumptions):
        from oal.models.registry import default_layers

        self.name, self.a = name, a
        self.cfg = full = shape_config(name, None)
        self.n_layers = full.num_hidden_layers
        self.layers = default_layers(full)
        self.hq, self.hkv, self.d = _dims(full)
        self.g = GROUPS[name]
        self.plain, self.lora = meta_decoder(name), with_lora(meta_decoder(name))
        self._cache: dict = {}
        params = sum(p.numel() for p in self.plain.layers.parameters()) * self.n_layers
        head = 0 if full.tie_word_embeddings else full.vocab_size * full.hidden_size
        self.n_params = params + full.vocab_size * full.hidden_size + head + full.hidden_size
        lora = sum(p.numel() for n, p in self.lora.named_parameters() if "lora_" in n) * self.n_layers
        self.n_lora = lora
        # kernel coefficients per converted layer: the (G+1) x (G+1) factor per query head
        self.n_kernel = len(self.layers) * self.hq * (self.g + 1) ** 2

    # measured pieces, cached by shape of the call
    def forward(self, batch: int, n: int, lora: bool) -> list[Op]:
        key = ("fwd", batch, n, lora)
        if key not in self._cache:
            self._cache[key] = layer_forward(self.lora if lora else self.plain, batch, n).ops
        return self._cache[key]

    def train(self) -> tuple[list[Op], list[Op], int]:
        if "train" not in self._cache:
            fwd, bwd, saved = layer_train(self.lora, N)
            self._cache["train"] = (fwd.ops, bwd.ops, saved)
        return self._cache["train"]

    def head(self, grad: bool, tokens: int | None = None) -> tuple[list[Op], list[Op], int]:
        key = ("head", grad, tokens)
        if key not in self._cache:
            fwd, bwd, tokens = head_chunk(self.cfg, grad, tokens)
            self._cache[key] = (fwd.ops, bwd.ops if bwd else [], tokens)
        return self._cache[key]

    def outside(self, batch: int, n: int) -> list[Op]:
        """Embedding lookup + final norm, measured."""
        key = ("outside", batch, n)
        if key not in self._cache:
            ids = torch.zeros(batch, n, dtype=torch.long, device="meta")
            with torch.no_grad(), Counter() as c:
                self.plain.norm(self.plain.embed_tokens(ids))
            self._cache[key] = c.ops
        return self._cache[key]

    def calib_update(self, g: int) -> tuple[list[Op], float]:
        key = ("calib", g)
        if key not in self._cache:
            c, cpu_s = calibration_update(self.cfg, g)
            self._cache[key] = (c.ops, cpu_s)
        return self._cache[key]

    def _core_parts(self, arm: str, batch: int, n: int, count: float, backward: bool = False) -> list[Part]:
        n_conv = 0 if arm == "softmax" else len(self.layers)
        parts = [Part("attention core: flash", [flash_core(batch, n, self.hq, self.hkv, self.d)], count *
                      (self.n_layers - n_conv), "analytic")]
        if backward:
            parts.append(Part("attention core backward: flash", [flash_core(batch, n, self.hq, self.hkv, self.d,
                                                                            backward=True)],
                              count * (self.n_layers - n_conv), "analytic"))
        if n_conv:
            g = self.g if arm == "oal" else 1
            parts.append(Part(f"attention core: OAL Triton (G={g})", [oal_core(batch, n, self.hq, self.hkv, self.d,
                                                                               g)], count * n_conv, "analytic"))
            if backward:
                parts.append(Part(f"attention core backward: OAL Triton (G={g})",
                                  [oal_core(batch, n, self.hq, self.hkv, self.d, g, backward=True)],
                                  count * n_conv, "analytic"))
        return parts

    def _eval_parts(self, arm: str, batch: int, n: int, count: float, lora: bool, layers: int | None = None,
                    head_tokens: float | None = None) -> list[Part]:
        """`count` forwards of [batch, n] through `layers` decoder layers (all) and the chunked head."""
        layers = self.n_layers if layers is None else layers
        parts = [Part("embedding + final norm", self.outside(batch, n), count, "measured (meta)"),
                 Part("decoder layers" + (" + LoRA" if lora else ""), self.forward(batch, n, lora),
                      count * layers, "measured (meta)")]
        cores = self._core_parts(arm, batch, n, count)
        if layers != self.n_layers:  # capture: softmax layers up to the last captured one
            cores = [Part("attention core: flash", [flash_core(batch, n, self.hq, self.hkv, self.d)], count * layers,
                          "analytic")]
        parts += cores
        if head_tokens is None:  # the chunked loss over every predicting position
            fwd, _, tokens = self.head(False)
            parts.append(Part("LM head + cross-entropy (chunked)", fwd, count * batch * (n - 1) / tokens,
                              "measured (meta)"))
        elif head_tokens:  # zero-shot: the logits kept (logits_to_keep) in one call
            parts.append(Part("LM head + log-softmax (kept positions)", self.head(False, head_tokens)[0], count,
                              "measured (meta)"))
        return parts

    def _base_memory(self) -> dict[str, float]:
        return {"weights (bf16)": 2.0 * self.n_params}

    def _block_capture_bytes(self, blocks: int, elem: int) -> float:
        """q, k, v, out of one layer for `blocks` blocks of N tokens."""
        return blocks * N * self.d * (2 * self.hq + 2 * self.hkv) * elem

    def stages(self) -> list[Stage]:
        paper, a = _rehearsal().PAPER, self.a
        blocks = paper["calib_train"] + paper["calib_val"]
        last = max(self.layers) + 1
        fwd_peak = _peak_op(self.forward(1, N, False))
        hidden = 2.0 * N * self.cfg.hidden_size * 2  # residual stream + layer output, bf16
        out = []
        capture_write = Op(0.0, self._block_capture_bytes(1, 2) * len(self.layers), "disk", 0)
        out.append(Stage("capture (10 blocks)", self._eval_parts("softmax", 1, N, blocks, False, last, 0) +
                         [Part("write q/k/v/out to disk", [capture_write], blocks, "analytic")],
                         {**self._base_memory(), "largest op": fwd_peak, "hidden states": hidden,
                          "one layer's capture of a block": self._block_capture_bytes(1, 2)}))
        boot = bootstrap_seconds(self.cfg, len(self.layers))
        prompts = self._eval_parts("softmax", 8, 128, 80 / 8, False, last, 0)  # grouping + held-out prompts
        long = self._eval_parts("softmax", 1, N, 1, False, last, 0)  # the App. A.3 long sequence
        out.append(Stage("analyze (B = 1000)", prompts + long, {**self._base_memory(), "largest op": fwd_peak,
                                                                  "hidden states": hidden}, cpu_seconds=2 * boot))
        out.append(self._calibrate_stage(paper))
        for arm in ARMS:
            out.append(self._adapt_stage(arm, paper))
        n_test = math.floor(_rehearsal().WT103_TEST_CHARS / a.chars_per_token / N)
        head_peak = _peak_op(self.head(False)[0])
        for arm in ARMS:
            parts = (self._eval_parts(arm, 1, N, n_test, False) + self._eval_parts(arm, 1, N, n_test, True))
            out.append(Stage(f"perplexity x2: {arm}", parts, {
                **self._base_memory(), "LoRA": 4.0 * self.n_lora,
                "largest op (layer or logits chunk)": max(fwd_peak, head_peak), "hidden states": hidden}))
        for arm in ARMS:
            out.append(self._zeroshot_stage(arm))
        return out

    def _calibrate_stage(self, paper) -> Stage:
        n_val = paper["calib_steps"] // paper["calib_val_every"] + 1
        parts, peaks = [], [0.0]
        per_layer = len(self.layers)
        parts.append(Part("read the layer's capture (disk)", [Op(0.0, self._block_capture_bytes(10, 2), "disk", 0)],
                          per_layer, "analytic"))
        for method, g in (("global", 1), ("oal", self.g)):
            ops, _ = self.calib_update(g)
            peaks.append(_peak_op(ops))
            parts.append(Part(f"{method} update (3 inits, all heads)", ops, per_layer * paper["calib_steps"],
                              "measured (CPU tensors)"))
            # validation: the linear-time forward on the 2 val blocks, the 3 inits stacked (fp32: tf32x3 dots)
            val = oal_core(paper["calib_val"], N, 3 * self.hq, 3 * self.hkv, self.d, g, kind="oal32")
            parts.append(Part(f"{method} validation (2 blocks)", [val], per_layer * n_val, "analytic"))
        states = paper["calib_val"] * 3 * self.hkv * (N // 64) * triton_rows(self.d) * (self.d + 1) * 4.0
        return Stage("calibrate (3 inits x 1000 updates)", parts, {
            **self._base_memory(), "one layer's capture (fp32, 10 blocks)": self._block_capture_bytes(10, 4),
            "largest transient (update op or validation states)": max(max(peaks), states)})

    def _adapt_stage(self, arm: str, paper) -> Stage:
        fwd, bwd, saved = self.train()
        hfwd, hbwd, tokens = self.head(True)
        steps, n_val = paper["adapt_steps"], paper["adapt_steps"] // paper["adapt_val_every"]
        chunks = (N - 1) / tokens
        trainable = self.n_lora + (0 if arm == "softmax" else self.n_kernel)
        opt = Op(0.0, trainable * 4.0 * 7, "fp32", 12)  # AdamW + clip: param, grad, m, v read, 3 written (fp32)
        parts = [Part("embedding + final norm", self.outside(1, N), steps, "measured (meta)"),
                 Part("decoder layer + LoRA: forward", fwd, steps * self.n_layers, "measured (meta)"),
                 Part("decoder layer + LoRA: backward", bwd, steps * self.n_layers, "measured (meta)"),
                 *self._core_parts(arm, 1, N, steps, backward=True),
                 Part("LM head + CE: forward, recompute, backward", hfwd + hfwd + hbwd, steps * chunks,
                      "measured (meta)"),
                 Part("AdamW + grad clip", [opt], steps, "analytic"),
                 *self._eval_parts(arm, 1, N, n_val * paper["val_blocks"], True)]
        n_conv = 0 if arm == "softmax" else len(self.layers)
        flash_saved = N * self.d * (2 * self.hq + 2 * self.hkv) * 2 + N * self.hq * 4  # q, k, v, o + lse
        oal_saved = N * self.d * (2 * self.hq + 2 * self.hkv) * 2 + N * self.hq * 4  # q, k, v, o + normaliser
        core_saved = (self.n_layers - n_conv) * flash_saved + n_conv * oal_saved
        transient = max(_peak_op(hfwd + hbwd), _peak_op(bwd), _peak_op(fwd))
        return Stage(f"adapt (512 updates): {arm}", parts, {
            **self._base_memory(), "LoRA + kernel: params, grads, AdamW m, v (fp32)": 16.0 * trainable,
            "activations saved for backward (all layers)": self.n_layers * saved + core_saved,
            "largest transient (logits chunk or layer op)": transient,
            "hidden-state gradients": 2.0 * N * self.cfg.hidden_size * 2})

    def _zeroshot_stage(self, arm: str) -> Stage:
        a, parts, peaks = self.a, [], [0.0]
        for task, (examples, choices) in ZEROSHOT.items():
            ctx, cont = a.zeroshot_tokens[task]
            batches = math.ceil(examples * choices / a.zeroshot_batch)
            parts += self._eval_parts(arm, a.zeroshot_batch, ctx + cont, batches, True,
                                      head_tokens=a.zeroshot_batch * (cont + 1))
            peaks.append(_peak_op(self.forward(a.zeroshot_batch, ctx + cont, True)))
        return Stage(f"zero-shot (3 sets): {arm}", parts, {**self._base_memory(), "LoRA": 4.0 * self.n_lora,
                                                           "largest op": max(peaks + [_peak_op(self.head(False)[0])])})


# ----------------------------------------------------------------------------------------------- results

def compose(shapes: dict[str, Shape], gpus: dict[str, GPU], a: Assumptions) -> dict:
    """{shape: {"stages": [{name, peak_gb, memory_gb{}, seconds{gpu}, parts[]}], "total_s": {gpu}, ...}}."""
    out = {}
    for name, shape in shapes.items():
        stages = shape.stages()
        rows = []
        for st in stages:
            rows.append({"stage": st.name, "peak_gb": st.peak_bytes / 1e9,
                         "memory_gb": {k: v / 1e9 for k, v in st.memory.items()},
                         "seconds": {g: st.seconds(gpu, a) for g, gpu in gpus.items()},
                         "cpu_seconds": st.cpu_seconds,
                         "parts": [{"name": p.name, "count": p.count, "source": p.source,
                                    "gflop": p.count * sum(o.flops for o in p.ops) / 1e9,
                                    "gbytes": p.count * sum(o.bytes for o in p.ops) / 1e9,
                                    "seconds": {g: p.count * seconds(p.ops, gpu, a) for g, gpu in gpus.items()}}
                                   for p in st.parts]})
        sens = {}
        for eff in a.oal_efficiency_range:
            alt = Assumptions(**{**asdict(a), "oal_efficiency": eff})
            sens[str(eff)] = {g: sum(st.seconds(gpu, alt) for st in stages) for g, gpu in gpus.items()}
        out[name] = {"layers": shape.n_layers, "converted": shape.layers, "groups": shape.g,
                     "parameters": shape.n_params, "lora_parameters": shape.n_lora,
                     "kernel_parameters": shape.n_kernel, "stages": rows,
                     "total_s": {g: sum(r["seconds"][g] for r in rows) for g in gpus},
                     "peak_gb": max(r["peak_gb"] for r in rows),
                     "fits": {g: max(r["peak_gb"] for r in rows) <= gpu.memory_gb for g, gpu in gpus.items()},
                     "total_s_at_oal_efficiency": sens}
    return out


def _fmt_s(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    gpus, a = result["gpus"], result["assumptions"]
    t = Table(title="oal run (paper protocol, arms oal/global/softmax) per stage: time / peak GPU memory (GB) - a "
                    "roofline model, not a measurement")
    t.add_column("stage", no_wrap=True)
    for name in result["shapes"]:
        for g in gpus:
            t.add_column(f"{name}\n{g}", justify="right")
    stages = [r["stage"] for r in next(iter(result["shapes"].values()))["stages"]]
    for i, st in enumerate(stages):
        t.add_row(st, *[f"{_fmt_s(s['stages'][i]['seconds'][g])} / {s['stages'][i]['peak_gb']:.1f}"
                        for s in result["shapes"].values() for g in gpus])
    t.add_row("[bold]total / peak", *[f"[bold]{_fmt_s(s['total_s'][g])} / {s['peak_gb']:.1f}"
                                      + ("" if s["fits"][g] else " (does not fit)")
                                      for s in result["shapes"].values() for g in gpus])
    lo, hi = (str(x) for x in a["oal_efficiency_range"])
    t.add_row(f"total at OAL kernel eff. {lo} / {hi}",
              *[f"{_fmt_s(s['total_s_at_oal_efficiency'][lo][g])} / {_fmt_s(s['total_s_at_oal_efficiency'][hi][g])}"
                for s in result["shapes"].values() for g in gpus])
    console = Console(width=250)
    console.print(t)
    console.print("[bold]Assumptions[/bold]")
    for k, v in result["assumption_notes"].items():
        console.print(f"  {k}: {v}")
    for line in result.get("checks", {}).get("lines", []):
        console.print(f"  check: {line}")


def assumption_notes(a: Assumptions, gpus: dict[str, GPU]) -> dict[str, str]:
    notes = {g: f"{gpu.name}: {gpu.bf16_tflops:g} TFLOPS bf16 dense, {gpu.fp32_tflops:g} FP32, {gpu.tf32_tflops:g} "
                f"TF32, {gpu.hbm_tbs:g} TB/s HBM, {gpu.memory_gb:g} GB (NVIDIA datasheets)" for g, gpu in gpus.items()}
    notes |= {
        "GEMM efficiency (MFU)": f"{a.mfu} of peak (bf16 layers; fp32 calibration on the FP32 peak)",
        "memory-bound ops": f"{a.bandwidth_fraction} of HBM bandwidth; every aten op counted unfused (eager)",
        "launch floor": f"{a.launch_us} us per dispatched op",
        "flash attention (softmax layers)": f"{a.flash_efficiency} of bf16 peak, causal FLOPs (analytic)",
        "OAL Triton kernel": f"{a.oal_efficiency} of bf16 peak (fp32 validation: of TF32/3) - NEVER RUN ON A GPU, "
                             f"a pessimistic guess; totals also at {a.oal_efficiency_range}",
        "groups per head": "G = " + ", ".join(f"{k} {v}" for k, v in GROUPS.items()) + " (layer maximum, assumed)",
        "disk": f"{a.disk_gbs} GB/s for the calibration capture",
        "grouping bootstrap": f"CPU seconds measured here x {a.host_cpu_factor} (it runs on the host CPU)",
        "WikiText-103 test": f"1.29e6 chars / {a.chars_per_token} chars per token, blocks of {N}, no-adapt + adapted",
        "zero-shot lengths": ", ".join(f"{k} {c}+{t} tokens" for k, (c, t) in a.zeroshot_tokens.items())
                             + f" (context+continuation, assumed), batch {a.zeroshot_batch}",
        "calibration": "no early stopping (upper bound); 11 validations of 2 blocks per method",
        "not modelled": "setup (tokenising WikiText-103), fidelity, select, regime, budget, compare stages; "
                        "Python overhead beyond the launch floor; liger fused CE (chunked CE assumed)",
    }
    return notes


# ----------------------------------------------------------------------------------------------- CPU checks

MEMORY_REFERENCE_GB = 2.63  # benchmarks.memory, Qwen shape, 1 layer, N = 4096, fp32 CPU: peak RSS (notes/24.md)
REHEARSAL = Path("/tmp/rehearsal-qwen/rehearsal.json")  # scripts/scale_rehearsal.py --full, where it has run


def cpu_gemm_gflops(m: int, k: int, n: int, reps: int = 3) -> float:
    """fp32 GEMM rate of this CPU at one [m, k] x [k, n] product, by process CPU time (a shared machine's wall
    time would count waiting)."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    best = math.inf
    for _ in range(reps + 1):
        t0 = time.process_time()
        a @ b
        best = min(best, time.process_time() - t0)
    return 2.0 * m * k * n / best / 1e9


def cpu_checks(shapes: dict[str, Shape]) -> dict:
    """The counts against this CPU: one Qwen-shaped layer forward at N = 4096 timed (fp32) against the CPU's GEMM
    rate; the adaptation step's memory model against benchmarks.memory's measurement; the rehearsal, if present."""
    from transformers import AutoModel

    name = "qwen2.5-0.5b"
    shape = shapes.get(name) or Shape(name, Assumptions())
    torch.manual_seed(0)
    model = AutoModel.from_config(shape_config(name), attn_implementation="cost_stand_in").eval()
    x = torch.randn(1, N, model.config.hidden_size)
    pos = torch.arange(N)[None]
    flops = layer_forward(meta_decoder(name, torch.float32), 1, N).flops
    times = []
    with torch.no_grad():
        for _ in range(3):
            t0 = time.process_time()
            model.layers[0](x, attention_mask=None, position_ids=pos, position_embeddings=model.rotary_emb(x, pos))
            times.append(time.process_time() - t0)
    layer_rate = flops / min(times) / 1e9
    gemm = cpu_gemm_gflops(N, model.config.hidden_size, model.config.intermediate_size)
    out = {"threads": torch.get_num_threads(), "layer_gflop": flops / 1e9, "layer_cpu_s": min(times),
           "layer_gflops": layer_rate, "gemm_gflops": gemm, "layer_over_gemm": layer_rate / gemm}
    lines = [f"Qwen layer forward, N = {N}, fp32 CPU ({out['threads']} thread(s), CPU time): {flops / 1e9:.1f} GFLOP "
             f"counted, {min(times):.2f} s -> {layer_rate:.1f} GFLOP/s = {100 * layer_rate / gemm:.0f}% of this "
             f"CPU's {gemm:.1f} GFLOP/s GEMM rate (its MLP GEMM, same clock)"]
    # memory: one adaptation step of a 1-layer Qwen, fp32, as benchmarks.memory runs it (no layer checkpointing)
    fp32 = with_lora(meta_decoder(name, torch.float32))
    _, _, saved = layer_train(fp32, N)
    hf, hb, _ = head_chunk(shape.cfg, True, dtype=torch.float32)
    weights = 4.0 * (sum(p.numel() for p in fp32.parameters()))
    model_gb = (weights + saved + _peak_op(hf.ops + hb.ops)) / 1e9
    out["memory_model_gb"], out["memory_reference_gb"] = model_gb, MEMORY_REFERENCE_GB
    lines.append(f"adaptation step, Qwen shape, 1 layer, fp32: modelled tensors {model_gb:.2f} GB (weights "
                 f"{weights / 1e9:.2f} + saved {saved / 1e9:.2f} + logits-chunk op) vs {MEMORY_REFERENCE_GB} GB peak "
                 "RSS measured by benchmarks.memory (RSS adds the interpreter and libraries, ~0.45 GB there)")
    upd = sum(shape.calib_update(g)[1] for g in (1, shape.g))
    cal_cpu = upd * 1000 * len(shape.layers)
    out["calibrate_cpu_s_implied"] = cal_cpu
    lines.append(f"calibration update on this CPU: global + OAL {upd:.2f} CPU s per layer-update -> "
                 f"{cal_cpu / 3600:.1f} CPU h for {len(shape.layers)} layers x 1000 (updates only)")
    if REHEARSAL.is_file():
        from oal.rundir.files import load_json

        reh = load_json(REHEARSAL)
        out["rehearsal"] = {k: reh.get(k) for k in ("full", "partial", "threads", "stages", "extrapolated_paper_s")}
        ext = reh.get("extrapolated_paper_s", {})
        if "calibrate" in ext:
            lines.append(f"rehearsal ({REHEARSAL}, {'full' if reh.get('full') else 'reduced'}"
                         f"{', partial' if reh.get('partial') else ''}): calibrate {ext['calibrate'] / 3600:.1f} CPU h "
                         f"at the paper's budget vs {cal_cpu / 3600:.1f} CPU h implied here")
        for arm in ARMS:
            ppl = reh.get("stages", {}).get(f"perplexity_no_adapt:{arm}")
            if not ppl or not reh.get("counts", {}).get("test"):
                continue
            per_block = (ppl.get("cpu_seconds") or ppl["seconds"]) / reh["counts"]["test"]
            implied = sum(p.count * sum(o.flops for o in p.ops) for p in
                          shape._eval_parts(arm, 1, N, 1, False)) / (gemm * 1e9)
            lines.append(f"rehearsal perplexity ({arm}, {reh.get('dtype')}, {reh.get('threads')} threads): "
                         f"{per_block:.0f} CPU s per block vs {implied:.0f} s for its FLOPs at this CPU's fp32 GEMM "
                         "rate (a lower bound: the operator and elementwise work run below it)")
        cpt = reh.get("tokenizer", {}).get("chars_per_token")
        if cpt:
            lines.append(f"rehearsal tokenizer: {cpt} chars/token (Qwen's BPE on its corpus) vs the "
                         f"{Assumptions().chars_per_token} assumed here for WikiText-103")
    else:
        lines.append(f"rehearsal: {REHEARSAL} not present (not compared)")
    out["lines"] = lines
    return out


# ----------------------------------------------------------------------------------------------- output

CATEGORIES = ("capture", "analyze", "calibrate", "adapt", "perplexity", "zero-shot")


def figure(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks._common import finish_figure

    # in the names' order, not the dicts': a JSON read back is key-sorted, and the figure is the one redrawn from it
    shapes = {n: result["shapes"][n] for n in SHAPE_NAMES if n in result["shapes"]}
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4.5))
    axes = list(axes) if len(shapes) > 1 else [axes]
    colors = plt.get_cmap("tab10")
    for ax, (name, s) in zip(axes, shapes.items(), strict=True):
        gpus = [g for g in GPU_NAMES if g in s["total_s"]]
        bottom = [0.0] * len(gpus)
        for i, cat in enumerate(CATEGORIES):
            hours = [sum(r["seconds"][g] for r in s["stages"] if r["stage"].startswith(cat)) / 3600 for g in gpus]
            ax.bar(gpus, hours, bottom=bottom, color=colors(i), label=cat)
            bottom = [b + h for b, h in zip(bottom, hours, strict=True)]
        ax.set_title(f"{name}: peak {s['peak_gb']:.0f} GB")
        ax.set_ylabel("hours (modelled)")
    finish_figure(fig, axes, "oal run, paper protocol: modelled stage time per GPU (3 arms)", path)


def run(shape_names=SHAPE_NAMES, gpu_names=tuple(GPUS), cpu_check: bool = True, a: Assumptions | None = None) -> dict:
    a = a or Assumptions()
    gpus = {g: GPUS[g] for g in gpu_names}
    shapes = {n: Shape(n, a) for n in shape_names}
    result = {"assumptions": asdict(a), "gpus": {g: asdict(gpu) for g, gpu in gpus.items()},
              "assumption_notes": assumption_notes(a, gpus), "seq_len": N, "arms": list(ARMS),
              "shapes": compose(shapes, gpus, a)}
    if cpu_check:
        result["checks"] = cpu_checks(shapes)
    return result


def main(args: argparse.Namespace) -> None:
    result = run(args.shapes, args.gpus, cpu_check=not args.no_cpu_check)
    from benchmarks._common import environment
    from oal.rundir.files import atomic_write_json

    result["environment"] = environment()
    atomic_write_json(args.json, result)
    figure(result, args.json.with_suffix(".png"))
    print_table(result)
    print(f"wrote {args.json} and {args.json.with_suffix('.png')}", file=sys.stderr)


if __name__ == "__main__":
    run_tool(main, ARGS)
