"""`oal.linearize` (the main job in one call) and `oal.add_lora` (its adaptation in any training loop), on a tiny
random Llama with a byte tokenizer: the calibrated kernels beat the uncalibrated ones on held-out text, `auto:K`
converts the best-scored layers, the folder it keeps reconverts the same base model (and refuses another), a second
call resumes, bad input names its argument; LoRA and the kernel train jointly in a plain loop and under
`transformers.Trainer`, and the merged result saves and reloads."""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import logging

import pytest
import torch

import oal
from oal.models.attention import converted_methods
from tests._tiny import save_tiny_llama

QK_SCALE = 12.0
TINY_CALIB = {"preset": "tiny"}  # 40 updates per start: enough to beat the defaults, quick on a CPU
TEXT = [inspect.getsource(argparse)]  # ~100 KB of bytes: 40 grouping prompts and 10 calibration blocks fit
HELD_OUT = inspect.getsource(json.decoder) + inspect.getsource(json.encoder)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama whose q/k projections are scaled up: random ones at init scale attend almost uniformly, where
    any kernel is exact; these logits spread over several units, as a trained model's do."""
    from transformers import LlamaForCausalLM

    path = save_tiny_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=512)
    model = LlamaForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(QK_SCALE)
            layer.self_attn.k_proj.weight.mul_(QK_SCALE)
    model.save_pretrained(path)
    return path


def _base(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def fixed(folder, tmp_path_factory):
    """Layer 1 (the default range of a 3-layer model) linearized with its folder kept."""
    model, tok = _base(folder)
    out = tmp_path_factory.mktemp("lin")
    return oal.linearize(model, tok, TEXT, method="oal", calib=TINY_CALIB, out_dir=out, progress=False), tok, out


def _held_out(tok, n: int = 4, length: int = 256) -> torch.Tensor:
    ids = tok(HELD_OUT, add_special_tokens=False)["input_ids"][: n * length]
    return torch.tensor(ids).reshape(n, length)


def test_calibrated_kernels_beat_the_uncalibrated_ones_on_held_out_text(folder, fixed):
    from oal.evaluate.fidelity import fidelity

    model, tok, _ = fixed
    calibrated = converted_methods(model)
    assert sorted(calibrated) == [1] and calibrated[1].name == "oal"
    raw = converted_methods(oal.convert(_base(folder)[0], [1], "oal"))
    base = _base(folder)[0]
    res = fidelity(base, _held_out(tok), {"calibrated": calibrated, "raw": raw}, [1])
    assert res["calibrated"]["relmse"] < 0.9 * res["raw"]["relmse"], res
    # the groups are App. B's (the analysis ran): more than the uncalibrated single group in some head
    assert int(calibrated[1].groups.max()) >= 1


def test_the_kept_folder_reconverts_the_same_base_model_and_refuses_another(folder, fixed, tmp_path):
    from transformers import LlamaForCausalLM

    model, tok, out = fixed
    ids = _held_out(tok, 1, 64)
    again = oal.load(out, _base(folder)[0])
    assert torch.equal(again(ids).logits, model(ids).logits)
    other = LlamaForCausalLM(copy.deepcopy(model.config)).eval()  # same shapes, other weights
    with pytest.raises(ValueError, match="state_dict_sha256|weights|tensors"):
        oal.load(out, other)


def test_a_second_call_resumes_from_the_checkpoints(folder, fixed, caplog):
    from oal.calibration.kernels import load_kernels

    model, tok, out = fixed
    with caplog.at_level(logging.INFO, logger="oal"):
        again = oal.linearize(_base(folder)[0], tok, TEXT, method="oal", calib=TINY_CALIB, out_dir=out,
                              progress=False)
    assert "checkpoint verified" in caplog.text
    first, second = load_kernels(out)[0][1], converted_methods(again)[1]
    assert torch.equal(first.factor, second.factor) and torch.equal(first.groups, second.groups)


@pytest.mark.parametrize("by,method", [("fidelity", "oal-swa"), ("probe", "global")])
def test_auto_k_converts_the_best_scored_layers(folder, tmp_path, by, method):
    model, tok = _base(folder)
    model = oal.linearize(model, tok, TEXT, layers="auto:2", method=method, window=16, sinks=2, select_by=by,
                          calib=TINY_CALIB, out_dir=tmp_path, progress=False)
    sel = json.loads((tmp_path / "selection.json").read_text())
    scores = {int(i): s for i, s in sel["scores"].items()}
    assert sel["candidates"] == [0, 1, 2] and sel["by"] == by
    best = sorted(sorted(scores, key=lambda i: (scores[i], i))[:2])
    assert sel["chosen"] == best == sorted(converted_methods(model))
    assert {m.name for m in converted_methods(model).values()} == {method}


def test_save_and_reload_give_the_same_model(fixed, tmp_path):
    model, tok, _ = fixed
    ids = _held_out(tok, 1, 64)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert torch.equal(oal.load(tmp_path)(ids).logits, model(ids).logits)


@pytest.mark.parametrize("kwargs,match", [
    ({"method": "softmax"}, "^method:"),
    ({"method": "nope"}, "^method:"),
    ({"select_by": "luck"}, "^select_by:"),
    ({"layers": [0, 7]}, "^layers:"),
    ({"layers": "auto:9"}, "^layers:"),
    ({"layers": "3-1"}, "^layers:"),
    ({"method": "oal-swa", "window": 512}, "^window:"),
    ({"grouping": "odd"}, "^grouping:"),
])
def test_bad_input_names_its_argument(folder, kwargs, match):
    model, tok = _base(folder)
    with pytest.raises(ValueError, match=match):
        oal.linearize(model, tok, TEXT, progress=False, **kwargs)


@pytest.mark.parametrize("texts", [["too short"], "no such corpus or file", [], [1, 2]])
def test_bad_texts_name_the_argument(folder, texts):
    model, tok = _base(folder)
    with pytest.raises(ValueError, match="^texts:"):
        oal.linearize(model, tok, texts, progress=False)


def _changed(before: dict, model) -> set[str]:
    now = {n: p for n, p in model.named_parameters()}
    return {n for n, p in before.items() if not torch.equal(p, now[n].detach())}


def test_add_lora_trains_lora_and_the_kernel_in_a_plain_loop_and_the_result_reloads(folder, fixed, tmp_path):
    model, tok, _ = fixed
    peft_model = oal.add_lora(copy.deepcopy(model))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert any("lora_A" in n for n in trainable) and any("lora_B" in n for n in trainable)
    assert [n for n in trainable if "lora_" not in n] == [n for n in trainable if n.endswith("factor")] != []
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    batch = _held_out(tok, 2, 64)
    peft_model.train()
    for _ in range(3):
        loss = peft_model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    changed = _changed(before, peft_model)
    assert any(n.endswith("factor") for n in changed) and any("lora_B" in n for n in changed)
    merged = peft_model.merge_and_unload().eval()
    merged.save_pretrained(tmp_path)
    ids = _held_out(tok, 1, 64)
    torch.testing.assert_close(oal.load(tmp_path)(ids).logits, merged(ids).logits)


def test_add_lora_trains_under_the_transformers_trainer(fixed, tmp_path):
    from transformers import Trainer, TrainingArguments

    model, tok, _ = fixed
    peft_model = oal.add_lora(copy.deepcopy(model), train_kernel=True)
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    data = [{"input_ids": row, "labels": row} for row in _held_out(tok, 4, 64)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2,
                             use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
                             remove_unused_columns=False, disable_tqdm=True)
    Trainer(model=peft_model, args=args, train_dataset=data).train()
    assert any(n.endswith("factor") for n in _changed(before, peft_model))


def test_add_lora_refuses_an_unconverted_model(folder):
    with pytest.raises(ValueError, match="^model:"):
        oal.add_lora(_base(folder)[0])
