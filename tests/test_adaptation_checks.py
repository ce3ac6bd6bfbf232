"""Adaptation audit: what an adapter reloads onto, non-finite validation, the checkpoint's file hashes, and the
training arithmetic (loss = hand cross-entropy, gradient accumulation = a bigger batch, the documented schedule)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from test_adapt import CFG, _blocks, _Kill, _run, _tiny_model

from oal.adaptation.adapter import load_adapter, save_adapter
from oal.adaptation.config import AdaptConfig
from oal.adaptation.train import _block_order, adapt
from oal.calibration.kernels import adaptation_start
from oal.methods import build_method
from oal.models.convert import convert as convert_model


def _dijiang(start: bool):
    """A tiny model with DiJiang in layer 1: 'calibrated' (theta moved from its initial zeros), or where LoRA
    adaptation starts a baseline (App. F.1: its initial values)."""
    model = _tiny_model()
    method = build_method("dijiang", 4, 2, 16, layer_idx=1)
    with torch.no_grad():
        method.theta.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    convert_model(model, [1], {1: adaptation_start(method) if start else method})
    return model


@pytest.mark.parametrize("train_kernel", [True, False])
def test_a_baseline_adapter_reloads_onto_its_calibrated_kernels_as_trained(tmp_path, train_kernel):
    """A run loads an adapter onto the calibrated model (`model_for(method)`), while a baseline trained from its
    initial kernel values. With frozen kernels (train_kernel=False) the adapter holds no kernel tensors, and the
    model kept its calibrated ones: logits other than the trained model's."""
    peft_model, res = adapt(_dijiang(start=True), _blocks(4, 12, 0), _blocks(2, 12, 1),
                            AdaptConfig(**{**CFG, "lr": 0.05, "train_kernel": train_kernel}), progress=False)
    save_adapter(peft_model, tmp_path / "adapter", res)
    ids = _blocks(2, 10, 5)
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
        got = load_adapter(_dijiang(start=False), tmp_path / "adapter")(input_ids=ids).logits
    assert torch.equal(got, want)


def test_a_non_finite_validation_nll_is_an_error(monkeypatch):
    """A NaN validation NLL is never 'better': with every validation NaN the run used to return the untrained
    start (best_step -1) as its selected checkpoint, saved and evaluated as an adapted model."""
    import oal.adaptation.train as train

    monkeypatch.setattr(train, "_validation_nll", lambda *a, **k: math.nan)
    with pytest.raises(FloatingPointError, match="validation NLL"):
        adapt(_tiny_model(convert="oal"), _blocks(4, 12, 0), _blocks(2, 12, 1), AdaptConfig(**CFG), progress=False)


def test_a_checkpoint_file_left_out_of_its_hashes_is_not_resumed(tmp_path):
    """Every file a resume reads is hashed in state.json: the optimizer's tensors too (an unlisted, edited
    optimizer.safetensors was resumed from)."""
    from safetensors.torch import load_file, save_file

    from oal.adaptation.checkpoint import read_checkpoint

    with pytest.raises(_Kill):
        _run(tmp_path, kill_after=5)
    path = tmp_path / "state.json"
    state = json.loads(path.read_text())
    names = set(load_file(tmp_path / "trainable.safetensors"))
    del state["sha256"]["optimizer.safetensors"]
    path.write_text(json.dumps(state))
    opt = load_file(tmp_path / "optimizer.safetensors")
    save_file({k: torch.zeros_like(v) for k, v in opt.items()}, tmp_path / "optimizer.safetensors")
    assert read_checkpoint(tmp_path, state["key"], names, 1) is None


def test_the_first_loss_is_the_hand_computed_next_token_cross_entropy():
    model = _tiny_model(convert="oal").double()
    reference = _tiny_model(convert="oal").double()  # LoRA starts as the identity (B = 0)
    train = _blocks(8, 12, 0)
    _, res = adapt(model, train, _blocks(2, 12, 1), AdaptConfig(**{**CFG, "steps": 1, "lora_dropout": 0.0}),
                   progress=False)
    ids = train[_block_order(8, 1, CFG["seed"])]
    with torch.no_grad():
        logits = reference(input_ids=ids).logits
    want = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    assert res.history[0]["loss"] == pytest.approx(float(want), abs=1e-12)


def test_gradient_accumulation_equals_the_bigger_batch():
    """batch 1 x 2 micro-batches makes the update batch 2 x 1 does (fp64: to rounding)."""
    runs = []
    for batch_size, grad_accum in ((2, 1), (1, 2)):
        cfg = AdaptConfig(**{**CFG, "steps": 4, "lora_dropout": 0.0, "batch_size": batch_size,
                             "grad_accum": grad_accum})
        runs.append(adapt(_tiny_model(convert="oal").double(), _blocks(8, 12, 0), _blocks(2, 12, 1), cfg,
                          progress=False))
    (a, ra), (b, rb) = runs
    assert ra.global_batch == rb.global_batch == 2
    assert [h["loss"] for h in ra.history] == pytest.approx([h["loss"] for h in rb.history], abs=1e-12)
    other = dict(a.named_parameters())
    for n, p in b.named_parameters():
        torch.testing.assert_close(p, other[n], rtol=0, atol=1e-12)


def test_learning_rate_is_linear_warmup_then_cosine_to_zero():
    cfg = AdaptConfig(**{**CFG, "steps": 20, "warmup_frac": 0.1, "lr": 1e-3, "val_every": 20})
    _, res = adapt(_tiny_model(), _blocks(4, 8, 0), _blocks(1, 8, 1), cfg, progress=False)
    warm = 2
    want = [1e-3 * (s / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (20 - warm))))
            for s in range(20)]
    assert [h["lr"] for h in res.history] == pytest.approx(want, abs=1e-15)


def test_frozen_kernels_are_not_skipped_silently():
    """train_kernel=True on a model whose kernel parameters the user froze (model.requires_grad_(False) before
    adapting) trains LoRA alone: said in a warning, not silently."""
    import logging

    from oal.adaptation.train import wrap_lora

    said = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("oal")  # the command line's logger does not propagate to pytest's caplog
    logger.addHandler(handler)
    try:
        _, names = wrap_lora(_tiny_model(convert="oal"), AdaptConfig(**CFG))
        assert names and not said
        _, names = wrap_lora(_tiny_model(convert="oal").requires_grad_(False), AdaptConfig(**CFG))
    finally:
        logger.removeHandler(handler)
    assert names == [] and any("kernel parameters are frozen" in m for m in said), said
