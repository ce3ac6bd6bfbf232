"""Identical adaptations write byte-identical adapter folders (issue 28), also in processes with different
PYTHONHASHSEED, where peft's target_modules set iterates in another order, and in different folders."""

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SRC = str(TESTS.parent / "src")
TARGETS = "{'q_proj', 'k_proj', 'v_proj', 'o_proj'}"

ADAPT = f"""
import sys
import torch
sys.path.insert(0, {str(TESTS)!r})
from _runs import LAYERS, random_methods
from _tiny import tiny_model
from oal.adaptation.adapter import save_adapter
from oal.adaptation.config import AdaptConfig
from oal.adaptation.train import adapt
from oal.models.convert import convert

model = convert(tiny_model("qwen2", 300), LAYERS, random_methods("oal", 6, 2, 8, seed=1))
gen = torch.Generator().manual_seed(0)
train, val = torch.randint(0, 300, (4, 12), generator=gen), torch.randint(0, 300, (2, 12), generator=gen)
peft_model, result = adapt(model, train, val, AdaptConfig(steps=2, val_every=1, lora_r=2, seed=0), progress=False)
save_adapter(peft_model, sys.argv[1], result)
"""


def _env(seed: int) -> dict:
    return {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": str(seed),
            "OMP_NUM_THREADS": "1"}


def _set_order(seed: int) -> list[str]:
    res = subprocess.run([sys.executable, "-c", f"print(list({TARGETS}))"], capture_output=True, text=True,
                         env=_env(seed), check=True)
    return res.stdout.strip()


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_identical_adaptations_are_byte_identical(tmp_path):
    seeds = [0]  # two hash seeds under which peft's set of target modules iterates in different orders
    seeds.append(next(s for s in range(1, 50) if _set_order(s) != _set_order(0)))
    folders = []
    for k, seed in enumerate(seeds):
        out = tmp_path / f"process{k}" / "adapter" / "oal"
        res = subprocess.run([sys.executable, "-c", ADAPT, str(out)], capture_output=True, text=True,
                             env=_env(seed), timeout=600)
        assert res.returncode == 0, res.stderr
        folders.append(_files(out))
    assert sorted(folders[0]) == ["adapt.json", "adapter_model.safetensors", "kernel_params.safetensors",
                                  "oal_adapter.json"]
    assert folders[0] == folders[1]
    lora = json.loads(folders[0]["oal_adapter.json"])["lora"]
    assert lora["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert lora["base_model_name_or_path"] is None  # no machine-specific path in the artefact
