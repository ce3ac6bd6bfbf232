"""Option interactions of the commands: an option that applies to nothing the command runs is refused with one
line naming it (not recorded and ignored), and a run's arm loads in a wider dtype than the run's with its adapter."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from _runs import IDS, LAYERS, logits, random_methods
from _tiny import save_tiny_llama
from typer.testing import CliRunner

from oal.adaptation.adapter import converted_model_sha256, save_adapter
from oal.adaptation.config import AdaptConfig
from oal.adaptation.train import wrap_lora
from oal.artefact.arms import adapter_dir, load_arm, load_converted
from oal.calibration.kernels import kernel_dir, save_kernels
from oal.cli import load_commands
from oal.models.convert import convert
from oal.models.registry import load_model


def _one_error_line(res, option: str, needle: str) -> None:
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    assert option in lines[0] and needle in lines[0], lines[0]


@pytest.mark.parametrize("args, option, needle", [
    (["--window", "64"], "--window", "sliding-window methods"),  # the default value, given: still ignored
    (["--methods", "oal,softmax", "--sinks", "4"], "--sinks", "sliding-window methods"),
    (["--tasks", "none", "--limit", "5"], "--limit", "--tasks other than none"),
    (["--tasks", "none", "--zeroshot-dir", "."], "--zeroshot-dir", "--tasks other than none"),
    (["--tasks", "arc_easy", "--task-file", "piqa={file}"], "--task-file", "piqa is not among the tasks"),
])
def test_run_refuses_an_option_nothing_reads(tmp_path, args, option, needle):
    """`oal run` recorded these in config.json and ran without them; the model named cannot load, so a command
    that accepts the option fails on --model instead, quickly."""
    task_file = tmp_path / "piqa.jsonl"
    task_file.write_text(json.dumps({"goal": "g", "sol1": "a", "sol2": "b", "label": 0}) + "\n")
    args = [a.format(file=task_file) for a in args]
    out = tmp_path / "run"
    res = CliRunner().invoke(load_commands(), ["run", "--out", str(out), "--model", str(tmp_path / "no-model"),
                                               "--no-progress", *args])
    _one_error_line(res, option, needle)
    assert not out.exists()


def test_evaluate_zeroshot_refuses_a_task_file_outside_tasks(tmp_path):
    task_file = tmp_path / "piqa.jsonl"
    task_file.write_text(json.dumps({"goal": "g", "sol1": "a", "sol2": "b", "label": 0}) + "\n")
    res = CliRunner().invoke(load_commands(), ["evaluate", "--out", str(tmp_path), "--zeroshot", "--tasks",
                                               "arc_easy", "--task-file", f"piqa={task_file}"])
    _one_error_line(res, "--task-file", "piqa is not among the tasks")


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """A run made in bfloat16 from a float32 checkpoint (as `oal run --dtype bfloat16` on the embedded model):
    kernels and an adapter for oal, an adapter for softmax, all on the bf16-rounded weights."""
    root = tmp_path_factory.mktemp("bf16")
    base = save_tiny_llama(root / "base")
    run = root / "run"
    mdl, _, provenance = load_model(str(base), dtype=torch.bfloat16)
    ms = random_methods("oal", 4, 2, 8, seed=0)
    save_kernels(ms, kernel_dir(run, "oal"), base_model=str(base), provenance=provenance)
    for name, methods in (("oal", ms), ("softmax", None)):
        arm = copy.deepcopy(mdl)
        if methods is not None:
            convert(arm, LAYERS, copy.deepcopy(methods))
        trained_on = converted_model_sha256(arm)
        peft_model, names = wrap_lora(arm, AdaptConfig(lora_r=2, lora_alpha=4, lora_dropout=0.0))
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for _, p in sorted(peft_model.named_parameters()):
                if p.requires_grad:
                    p.add_(0.05 * torch.randn(p.shape, generator=gen).to(p.dtype))
        save_adapter(peft_model, adapter_dir(run, name), kernel_names=names, base_sha256=trained_on)
    record = {"model": str(base), "state_dict_sha256": provenance["state_dict_sha256"],
              "dtype": provenance["dtype"], "sha256": provenance["sha256"]}
    (run / "config.json").write_text(json.dumps({"config": {"dtype": "bfloat16"}, "model": record}))
    return run


@pytest.mark.parametrize("method", ["oal", "softmax"])
def test_arm_of_a_bf16_run_loads_in_float32_with_its_adapter(bf16_run, method):
    """`oal generate/convert/evaluate --dtype float32` on a bfloat16 run: the float32 checkpoint's unrounded weights
    matched no adapter (a one-line error blaming the adapter); now the run's model, widened exactly."""
    run_model, _, _ = load_arm(bf16_run, method)
    wide, _, info = load_arm(bf16_run, method, dtype=torch.float32)
    assert info["adapter"] is not None
    assert next(wide.model.embed_tokens.parameters()).dtype == torch.float32
    narrow, widened = run_model.state_dict(), wide.state_dict()
    assert narrow.keys() == widened.keys()
    for name, a in narrow.items():
        assert torch.equal(a.float(), widened[name].float()), name  # the run's weights, not the checkpoint's
    ids = IDS[:, :8]
    torch.testing.assert_close(logits(wide, ids), logits(run_model, ids).float(), atol=0.1, rtol=0.05)


def test_unmerged_arm_of_a_bf16_run_widens_too(bf16_run):
    wide, _, info = load_converted(bf16_run, "oal", merge=False, dtype=torch.float32)
    assert not info["merged"]
    assert {p.dtype for n, p in wide.named_parameters() if ".oal_method." not in n} == {torch.float32}


@pytest.mark.parametrize("methods", [["swa"], ["swa", "softmax"]])
def test_summary_says_softmax_was_adapted_only_when_it_was(methods):
    """`oal run --methods swa` has no softmax arm; the report's summary said softmax was adapted with LoRA too."""
    from oal.pipeline.report_summary import summary_section

    ppl = {m: 70.0 + i for i, m in enumerate(methods)}
    text = "\n".join(summary_section({"methods": methods, "perplexity": ppl, "perplexity_no_adapt": ppl,
                                      "model": "m", "converted_layers": [1]}))
    assert ("softmax adapted with LoRA too" in text) == ("softmax" in methods)
    assert ("no softmax arm in this run" in text) == ("softmax" not in methods)
