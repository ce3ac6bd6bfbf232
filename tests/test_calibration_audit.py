"""Calibration and analysis audit: non-finite activations named by layer, the processes of a launch agreeing on
the calibration's settings, and resuming a killed calibration."""

from __future__ import annotations

import pytest
import torch
from _dist_worker import calibration_inputs
from _tiny import tiny_model
from test_pipeline import _cfg, assets  # noqa: F401  (the fixture: tiny model and corpus of `oal run`)

import oal.calibration.resume as resume
from oal.analysis import analyze
from oal.calibration.data import CalibConfig
from oal.errors import InputError
from oal.launch import Ranks

VOCAB = 61

# ----------------------------------------------------------------------------------------- non-finite activations


def _overflowing_model():
    """The tiny GQA model (6 query heads, 2 KV heads, d = 8) in float16, its weights finite, whose layer 1 keys
    overflow in KV head 0: k = 60000 there before RoPE, which rotates pairs into up to 60000 * sqrt(2), past
    float16's 65504 (and the softmax of its query heads 0-2 follows)."""
    model = tiny_model("qwen2", VOCAB).half()
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        attn.k_proj.weight[:8] = 0.0
        attn.k_proj.bias[:8] = 6e4
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return model


def test_analysis_names_the_layer_whose_attention_overflows(tmp_path):
    """Layer 1's keys overflow in float16: the analysis failed as "q, k: non-finite values", naming no layer. Now
    it names layer 1, the tensor, its heads and the fix."""
    prompts = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError) as info:
        analyze(_overflowing_model(), None, prompts, [0, 1, 2], tmp_path, figures=False, progress=False,
                min_groups=1)
    message = str(info.value)
    assert message.startswith("model: layer 1's attention is non-finite (NaN or inf) on the grouping prompts: "
                              "k in KV head 0;"), message
    assert "float16" in message and "--dtype float32" in message and "\n" not in message
    assert not (tmp_path / "groups.json").exists()


def test_calibration_names_the_layer_whose_attention_overflows(tmp_path):
    """The same model's calibration failed as "k: non-finite values (NaN or inf) in the captured attention
    tensors", naming no layer."""
    _, blocks, _, _, kw = calibration_inputs()
    with pytest.raises(ValueError) as info:
        resume.calibrate_directory(tmp_path, _overflowing_model(), blocks, [0, 1, 2], ["global"], **kw)
    message = str(info.value)
    assert message.startswith("model: layer 1's attention is non-finite (NaN or inf) on the calibration training "
                              "blocks: k in KV head 0;"), message
    assert "--dtype float32" in message
    assert not (tmp_path / "calibration.json").exists()


# ----------------------------------------------------------------------------------------- processes that differ


class _Gathered(Exception):
    pass


class _LaunchOfTwo(Ranks):
    """A launch of two processes without torch.distributed. Without `theirs`, it stands for process 1: its first
    collective (`gather`) records what it sent and stops it. With `theirs` (process 1's record), it stands for
    process 0, whose `gather` gets both."""

    def __init__(self, theirs=None):
        self.index, self.size, self.state = 0, 2, None
        self.theirs, self.sent = theirs, []

    def gather(self, obj) -> list:
        if self.theirs is None:
            self.sent.append(obj)
            raise _Gathered
        return [obj, self.theirs]

    def broadcast(self, obj):
        return obj


def _as_two_processes(monkeypatch, where, call, mine: dict, theirs: dict):
    """Run `call(**theirs)` as process 1 (to its first collective), then `call(**mine)` as process 0; `where`: the
    module whose `ranks` the call uses."""
    one = _LaunchOfTwo()
    monkeypatch.setattr(where, "ranks", lambda *a, **k: one)
    with pytest.raises(_Gathered):
        call(**theirs)
    monkeypatch.setattr(where, "ranks", lambda *a, **k: _LaunchOfTwo(one.sent[0]))
    return call(**mine)


def test_calibration_processes_given_other_settings_are_refused(monkeypatch, tmp_path):
    """`torchrun ... oal calibrate` with another --seed on one process: each process calibrated its share of the
    layers with its own seed, and the main process wrote them all as one calibration. Now every process refuses,
    naming the setting, before anything is captured or written."""
    import oal.launch

    model, blocks, layers, methods, kw = calibration_inputs()

    def call(seed):
        cfg = CalibConfig.preset("tiny", max_steps=6, val_every=3, seed=seed)
        return resume.calibrate_directory(tmp_path / "out", model, blocks, layers, methods,
                                          **{**kw, "cfg": cfg, "seed": seed})

    with pytest.raises(InputError) as info:
        _as_two_processes(monkeypatch, oal.launch, call, {"seed": 0}, {"seed": 7})
    assert str(info.value.message).startswith("the processes of this launch differ in seed (process 0: 0, process 1: "
                                              "7)"), info.value.message
    assert info.value.param == "--seed"
    assert not (tmp_path / "out").exists()


def test_run_processes_given_other_settings_are_refused(assets, monkeypatch, tmp_path):  # noqa: F811
    """`torchrun ... oal run` with another --seeds on one process: calibration shared the layers out and each
    process fitted its own with its own seed (adaptation's check came later, and covers its own settings only).
    Now setup refuses on every process, naming the setting, before the run directory is written."""
    import oal.pipeline.base
    from oal.pipeline.decoder import Run

    def call(seed):
        Run(_cfg(assets, seed=seed, methods=["oal"], layers=[1]), tmp_path / "run", progress=False).setup()

    with pytest.raises(InputError) as info:
        _as_two_processes(monkeypatch, oal.pipeline.base, call, {"seed": 42}, {"seed": 43})
    assert info.value.message.startswith("the processes of this launch differ in seed (process 0: 42, process 1: "
                                         "43)"), info.value.message
    assert info.value.param == "--seed"
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_run_processes_given_the_same_settings_agree(assets, monkeypatch, tmp_path):  # noqa: F811
    """Two processes of one command pass setup (the model, corpus and blocks are compared by content)."""
    import oal.pipeline.base
    from oal.pipeline.decoder import Run

    def call(out):
        run = Run(_cfg(assets, methods=["oal"], layers=[1]), tmp_path / out, progress=False)
        run.setup()
        return run

    run = _as_two_processes(monkeypatch, oal.pipeline.base, call, {"out": "run"}, {"out": "elsewhere"})
    assert (run.dir / "config.json").is_file()


# ----------------------------------------------------------------------------------------- resume


def test_a_calibration_killed_after_its_capture_resumes_with_more_layers(monkeypatch, tmp_path):
    """`oal calibrate --methods global --layers 0-1` killed in layer 1, then rerun with --layers 0-2: the capture
    of layers 0-1 was reused (its key did not hold the layers), and every rerun failed with "capture: no data for
    role 'calib_train', layer 2". Now layer 2 is captured and the result equals an uninterrupted calibration."""
    from safetensors.torch import load_file

    model, blocks, _, _, kw = calibration_inputs()
    kw = {**kw, "groups": {}}  # global: no groups, so nothing in the key depends on the layers
    fit = resume.calibrate_methods

    def killed_in_layer_1(*args, layer, **kwargs):
        if layer == 1:
            raise KeyboardInterrupt
        return fit(*args, layer=layer, **kwargs)

    monkeypatch.setattr(resume, "calibrate_methods", killed_in_layer_1)
    with pytest.raises(KeyboardInterrupt):
        resume.calibrate_directory(tmp_path / "killed", model, blocks, [0, 1], ["global"], **kw)
    assert (tmp_path / "killed" / ".oal" / "capture" / "manifest.json").is_file()
    monkeypatch.setattr(resume, "calibrate_methods", fit)
    resume.calibrate_directory(tmp_path / "killed", model, blocks, [0, 1, 2], ["global"], **kw)
    resume.calibrate_directory(tmp_path / "whole", model, blocks, [0, 1, 2], ["global"], **kw)
    got, want = (load_file(str(tmp_path / d / "kernels" / "global" / "kernels.safetensors"))
                 for d in ("killed", "whole"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


# ----------------------------------------------------------------------------------------- small heads


def test_a_layer_shared_method_calibrates_on_a_one_head_layer():
    """SpectraFormer's parameters are the layer's; on a layer of one query head the fit took them per head (one
    unit, one head) and failed with an IndexError. Now the batched and the one-at-a-time fits agree."""
    from oal.calibration.data import LayerData
    from oal.calibration.fit import calibrate_layer, calibrate_layer_sequential
    from oal.calibration.loss import _val_mse
    from oal.methods import build_method

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 1, 16, 8, generator=gen) for _ in range(3))
    data = LayerData(q, k, v, build_method("softmax", 1, 1, 8)(q, k, v))
    cfg = CalibConfig.preset("tiny", max_steps=6, val_every=3)
    method = build_method("spectraformer", 1, 1, 8, seed=0)
    batched, one = (fit(method, data, data, cfg, layer=0) for fit in (calibrate_layer, calibrate_layer_sequential))
    assert not batched.per_head and [h.head for h in batched.heads] == [-1]
    assert set(batched.params) == set(one.params)
    assert all(torch.equal(batched.params[n], one.params[n]) for n in one.params)
    fitted = batched.apply(build_method("spectraformer", 1, 1, 8, seed=0))
    assert float(_val_mse(fitted, data, 1).mean()) == pytest.approx(batched.heads[0].val_mse, rel=1e-5)


def test_analysis_of_heads_of_fewer_than_five_dims(tmp_path):
    """A toy model's head of d = 4 dims: the analysis failed after its capture with topk's "selected index k out
    of range" (its top-5 statistics). Now they are over all d dims: the whole contribution, a share of 1."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64)).eval()
    prompts = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
    summary = analyze(model, None, prompts, [0, 1], tmp_path, heldout=prompts, figures=False, progress=False,
                      min_groups=1, n_bootstrap=20)
    assert summary["head_dim"] == 4
    assert summary["concentration"]["mean"]["real_top5"] == pytest.approx(1.0)
    assert summary["stability_inputs"]["mean_top5_overlap"] == 4  # the same prompts held out: every dim again
