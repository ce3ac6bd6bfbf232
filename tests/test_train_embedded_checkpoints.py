"""scripts/train_embedded_model.py's checkpoints: a resume restores the weights and the optimizer's moments exactly,
and refuses a checkpoint whose tensor files no longer have the SHA256 its state.json recorded."""

from __future__ import annotations

import runpy
from argparse import Namespace
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_embedded_model.py"


@pytest.fixture(scope="module")
def script():
    return Namespace(**runpy.run_path(str(SCRIPT), run_name="train_embedded_model"))  # its functions, not main()


def _trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 5)).square().sum().backward()
    opt.step()
    return model, opt


def test_a_checkpoint_resumes_exactly_and_refuses_a_changed_file(script, tmp_path):
    model, opt = _trained(0)
    script.save_checkpoint(tmp_path, 7, model, opt, 1.5, [2.0])
    ck = script.latest_checkpoint(tmp_path)
    fresh, fresh_opt = _trained(1)
    meta = script.load_checkpoint(ck, fresh, fresh_opt)
    assert meta["step"] == 7 and set(meta["sha256"]) == {"model.safetensors", "optimizer.safetensors"}
    for (_, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg_sq"], fresh_opt.state[b]["exp_avg_sq"])
    data = (ck / "optimizer.safetensors").read_bytes()
    (ck / "optimizer.safetensors").write_bytes(data[:-4] + bytes(4))  # the moments' last value zeroed
    with pytest.raises(ValueError, match="optimizer.safetensors: its SHA256 is not the one in state.json"):
        script.load_checkpoint(ck, *_trained(2))
