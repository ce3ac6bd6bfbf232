"""benchmarks.cost_model: the roofline composition on hand-computable cases, and the op counts against
FlopCounterMode and the analytic 2 x params x tokens (no wall-clock assertion anywhere)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import _cost_counts as counts
from benchmarks import cost_model as cm

GPU = cm.GPU("toy", bf16_tflops=100.0, fp32_tflops=10.0, tf32_tflops=30.0, hbm_tbs=2.0, memory_gb=8.0)
A = cm.Assumptions(mfu=0.5, bandwidth_fraction=0.5, launch_us=10.0, flash_efficiency=0.25, oal_efficiency=0.1,
                   disk_gbs=1.0)


def test_op_seconds_is_the_slowest_roof():
    assert cm.op_seconds(cm.Op(1e12, 0.0, "bf16"), GPU, A) == pytest.approx(1e12 / 50e12)  # compute: 20 ms
    assert cm.op_seconds(cm.Op(1e12, 0.0, "fp32"), GPU, A) == pytest.approx(1e12 / 5e12)  # fp32 peak: 200 ms
    assert cm.op_seconds(cm.Op(1e9, 1e12, "bf16"), GPU, A) == pytest.approx(1.0)  # memory: 1e12 B at 1 TB/s
    assert cm.op_seconds(cm.Op(0.0, 0.0, "bf16", launches=1000), GPU, A) == pytest.approx(0.01)  # launch floor
    assert cm.op_seconds(cm.Op(1e12, 0.0, "flash"), GPU, A) == pytest.approx(1e12 / 25e12)
    assert cm.op_seconds(cm.Op(1e12, 0.0, "oal"), GPU, A) == pytest.approx(1e12 / 10e12)
    assert cm.op_seconds(cm.Op(1e12, 0.0, "oal32"), GPU, A) == pytest.approx(1e12 / 1e12)  # tf32x3: TF32 / 3
    assert cm.op_seconds(cm.Op(0.0, 3e9, "disk", 0), GPU, A) == pytest.approx(3.0)


def test_stage_sums_parts_counts_and_memory():
    ops = [cm.Op(1e12, 0.0, "bf16"), cm.Op(0.0, 1e12, "bf16")]  # 20 ms + 1 s per repetition
    stage = cm.Stage("toy", [cm.Part("p", ops, 3, "analytic"), cm.Part("q", [cm.Op(0, 0, "bf16", 2)], 10, "x")],
                     {"weights": 1e9, "activations": 2.5e9}, cpu_seconds=4.0)
    assert stage.seconds(GPU, A) == pytest.approx(3 * 1.02 + 10 * 2e-5 + 4.0)
    assert stage.peak_bytes == pytest.approx(3.5e9)
    assert stage.seconds(GPU, cm.Assumptions(**{**A.__dict__, "host_cpu_factor": 0.5})) == pytest.approx(
        3 * 1.02 + 10 * 2e-5 + 2.0)


def test_analytic_cores_scale_as_their_equations():
    flash, flash2 = counts.flash_core(1, 1000, 4, 2, 16), counts.flash_core(1, 2000, 4, 2, 16)
    assert flash2.flops == pytest.approx(4 * flash.flops)  # quadratic in N
    assert flash.flops == 2.0 * 1000**2 * 16 * 4  # causal: half of 4 N^2 d Hq
    oal, oal2 = counts.oal_core(1, 1024, 4, 2, 16, 3), counts.oal_core(2, 2048, 4, 2, 16, 3)
    assert oal2.flops == pytest.approx(4 * oal.flops)  # linear in N and in the batch
    fp32 = counts.oal_core(1, 1024, 4, 2, 16, 3, kind="oal32")
    assert counts.oal_core(1, 1024, 4, 2, 16, 3, kind="oal32", backward=True).flops == 2 * fp32.flops
    # half inputs at d <= 64: the forward at 128-token chunks (its intra-chunk Eq. 7 term twice as wide), the
    # backward at 64 (oal.ops.triton.tiles.FWD_CHUNK)
    assert oal.flops - fp32.flops == 2.0 * 1024 * 4 * 64 * (4 * 16 + 17)
    assert counts.oal_core(1, 1024, 4, 2, 16, 3, backward=True).flops == 2 * fp32.flops
    assert counts.triton_rows(64) == 1 + 64 + 256 * 10  # d = 64: 4 feature blocks, 10 block pairs
    assert counts.triton_rows(128) == 1 + 128 + 256 * 36
    assert counts.triton_rows(17) == 1 + 32 + 256 * 3  # d padded to 32


TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512)


@pytest.fixture(scope="module")
def tiny(monkeypatch_module):
    """The tiny Llama shape, registered as a named shape of the cost model."""
    monkeypatch_module.setattr(counts, "LLAMA_8B", ("llama", {**TINY, "num_hidden_layers": 3}))
    return "llama-3.1-8b"


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_layer_count_matches_flop_counter_and_two_params_tokens(tiny):
    model = counts.meta_decoder(tiny)
    batch, n = 2, 37
    c = counts.layer_forward(model, batch, n)
    x, pos, pe = counts._layer_call(model, batch, n, False)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model.layers[0](x, attention_mask=None, position_ids=pos, position_embeddings=pe)
    assert c.flops == fc.get_total_flops()  # the dispatch mode sees what FlopCounterMode sees
    params = sum(p.numel() for p in model.layers[0].parameters())
    norms = 2 * TINY["hidden_size"]  # RMSNorm weights: no matmul
    assert c.flops == pytest.approx(2 * (params - norms) * batch * n, rel=1e-9)  # no bias: exactly 2 P T
    assert c.flops == pytest.approx(2 * params * batch * n, rel=0.01)
    assert counts.layer_forward(model, batch, 2 * n).flops == pytest.approx(2 * c.flops)  # linear in N


def test_frozen_backward_costs_one_forward_and_lora_adds_little(tiny):
    model = counts.with_lora(counts.meta_decoder(tiny))
    fwd, bwd, saved = counts.layer_train(model, 64)
    plain = counts.layer_forward(counts.meta_decoder(tiny), 1, 64).flops
    lora = 8 * (4 * TINY["hidden_size"] + 2 * 2 * 16 + 2 * 4 * 16)  # r x (in + out) of q, k, v, o
    assert fwd.flops == pytest.approx(plain + 2 * lora * 64, rel=1e-9)
    # input gradients of every GEMM (1x) + LoRA weight gradients (1x of the LoRA part)
    assert bwd.flops == pytest.approx(plain + 4 * lora * 64, rel=1e-9)
    assert saved > 0


def test_saved_bytes_skip_parameters():
    lin = torch.nn.Linear(10, 10, bias=False)
    x = torch.randn(10, 10, requires_grad=True)
    with counts.Saved(lin) as s:
        (lin(x) * 1.0).sum()
    assert s.bytes == 10 * 10 * 4  # the input x; the weight is resident anyway
    with counts.Saved(lin) as s:
        (x * x).sum()
    assert s.bytes == 10 * 10 * 4  # x once (the same storage saved twice)


def test_calibration_update_counts_its_gemms(tiny):
    """One update: group scores q_g k^T (no gradient: data), L^T s_bar and w v (forward + weight-side
    backward), the other ops elementwise."""
    cfg = counts.shape_config(tiny, None)
    g, n, copies, nq, hq, d = 3, 64, 3, 32, 4, 16
    ops, _ = counts.calibration_update(cfg, g, n=n, copies=copies)
    scores = 2 * hq * g * nq * d * n
    factor = 2 * hq * copies * (g + 1) ** 2 * nq * n
    values = 2 * copies * hq * nq * n * d
    assert ops.flops == pytest.approx(scores + 2 * factor + 2 * values, rel=0.02)
    assert all(o.kind == "fp32" for o in ops.ops)  # calibration runs in fp32


def test_head_chunk_is_the_head_gemm(tiny):
    cfg = counts.shape_config(tiny, None)
    fwd, bwd, tokens = counts.head_chunk(cfg, True)
    assert tokens == counts.head_chunk(cfg, False)[2]
    assert fwd.flops == 2 * tokens * cfg.hidden_size * cfg.vocab_size
    assert bwd.flops == fwd.flops  # the frozen head: input gradient only


def test_memory_of_a_tiny_shape_adds_up(tiny):
    shape = cm.Shape(tiny, cm.Assumptions())
    stages = {s.name: s for s in shape.stages()}
    adapt = stages["adapt (512 updates): oal"]
    w = 2.0 * shape.n_params
    assert adapt.memory["weights (bf16)"] == w
    assert shape.n_params == pytest.approx(sum(p.numel() for p in shape.plain.layers.parameters()) * 3
                                           + 2 * TINY["vocab_size"] * TINY["hidden_size"] + TINY["hidden_size"])
    assert adapt.peak_bytes == pytest.approx(sum(adapt.memory.values()))
    assert adapt.peak_bytes > stages["perplexity x2: oal"].peak_bytes > w
    for s in stages.values():
        assert math.isfinite(s.seconds(GPU, A)) and s.seconds(GPU, A) > 0
    # a GPU twice as fast everywhere halves every stage's GPU time (the launch floor and disk aside)
    fast = cm.GPU("2x", 200.0, 20.0, 60.0, 4.0, 8.0)
    no_floor = cm.Assumptions(**{**A.__dict__, "launch_us": 0.0, "disk_gbs": math.inf})
    ppl = stages["perplexity x2: softmax"]
    assert ppl.seconds(fast, no_floor) == pytest.approx(ppl.seconds(GPU, no_floor) / 2)
