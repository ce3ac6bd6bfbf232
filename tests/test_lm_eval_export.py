"""lm-eval on an exported converted model (issue 27): `python -m oal.lm_eval` is lm-eval's own command line with
oal registered, so a local multiple-choice task (--include_path) scored with --log_samples gives the converted
model's log-likelihoods, equal to oal's own scorer on `oal.load(EXPORT)` and unlike the softmax base model's. HFLM
on an unmerged export gets the LoRA too; HFLM's peft= route refuses a run's adapter."""

import json
import os
import subprocess
import sys

import pytest
import torch
from _runs import SRC, make_run
from _tiny import save_tiny_llama
from transformers import AutoModelForCausalLM, AutoTokenizer

import oal
from oal.artefact.arms import adapter_dir
from oal.artefact.export import export
from oal.evaluate.zeroshot import Example, score_examples

ROWS = [
    {"question": "Where does the sun rise?", "choices": ["in the east", "in the west", "under the sea"], "label": 0},
    {"question": "What do cats drink?", "choices": ["milk", "petrol"], "label": 0},
    {"question": "How many legs has a spider?", "choices": ["six", "eight", "ten", "two"], "label": 1},
    {"question": "Which is heavier, lead or air?", "choices": ["air", "lead"], "label": 1},
]
TASK = """task: oal_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    root = tmp_path_factory.mktemp("lmeval")
    base = save_tiny_llama(root / "base")
    run = make_run(root, base, {"oal": True})
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tasks / "oal_tiny_mc.yaml").write_text(TASK.format(data=tasks / "data.jsonl"))
    return {"base": base, "run": run, "tasks": tasks, "merged": export(run, "oal", root / "merged"),
            "unmerged": export(run, "oal", root / "unmerged", merge=False)}


def _ours(model, tokenizer) -> list[list[float]]:
    examples = [Example(f"Question: {r['question']}\nAnswer:", r["choices"], r["label"]) for r in ROWS]
    return [[ll for ll, _ in ex] for ex in score_examples(model, tokenizer, examples, batch_size=2)]


@pytest.mark.slow
def test_python_m_oal_lm_eval_scores_the_converted_model(art, tmp_path):
    out = tmp_path / "out"
    # add_bos_token=False: lm-eval otherwise encodes with the tokenizer's special tokens, and this tiny model's ByT5
    # tokenizer appends </s> to every context (oal's scorer adds none)
    cmd = [sys.executable, "-m", "oal.lm_eval", "--model", "hf", "--model_args",
           f"pretrained={art['merged']},dtype=float32,add_bos_token=False", "--tasks", "oal_tiny_mc",
           "--include_path", str(art["tasks"]), "--log_samples", "--output_path", str(out), "--batch_size", "2",
           "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    (samples,) = out.rglob("samples_oal_tiny_mc_*.jsonl")
    lines = sorted((json.loads(x) for x in samples.read_text().splitlines()), key=lambda s: s["doc_id"])
    theirs = [[float(r[0][0]) for r in s["resps"]] for s in lines]
    assert [[a["arg_1"] for a in s["arguments"].values()] for s in lines] == [
        [" " + c for c in r["choices"]] for r in ROWS]
    tok = AutoTokenizer.from_pretrained(art["merged"])
    converted = _ours(oal.load(art["merged"]), tok)
    softmax = _ours(AutoModelForCausalLM.from_pretrained(art["base"]), tok)
    flat = torch.tensor([x for row in theirs for x in row], dtype=torch.float64)
    assert torch.allclose(flat, torch.tensor([x for row in converted for x in row], dtype=torch.float64),
                          rtol=0, atol=1e-4)
    assert (flat - torch.tensor([x for row in softmax for x in row], dtype=torch.float64)).abs().max() > 1e-2


def test_hflm_on_an_unmerged_export_and_peft_refusal(art):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(art["unmerged"]), backend="causal", batch_size=2, device="cpu", dtype="float32",
              add_bos_token=False)
    assert getattr(lm.model, "_hf_peft_config_loaded", False)  # converted + trained kernels + LoRA
    requests = [Instance("loglikelihood", {}, (f"Question: {r['question']}\nAnswer:", " " + c), i)
                for i, r in enumerate(ROWS) for c in r["choices"]]
    got = [ll for ll, _ in lm.loglikelihood(requests)]
    want = [x for row in _ours(oal.load(art["unmerged"]), lm.tokenizer) for x in row]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
    with pytest.raises(ValueError, match="Can't find 'adapter_config.json'"):
        HFLM(pretrained=str(art["base"]), peft=str(adapter_dir(art["run"], "oal")), device="cpu")


def test_without_lm_eval_one_clean_line(monkeypatch, capsys):
    from oal import lm_eval as entry

    monkeypatch.setitem(sys.modules, "lm_eval.__main__", None)  # as if lm-eval were not installed
    with pytest.raises(SystemExit) as exc:
        entry.main(["--tasks", "x"])
    assert exc.value.code == 2 and "Error: lm-eval is not installed" in capsys.readouterr().err


def _bad(art, tmp_path, case):
    """(argv for python -m oal.lm_eval, words its one-line error must hold) for each kind of bad input."""
    if case == "missing path":
        return ["--model_args", f"pretrained={tmp_path / 'nothing'}", "--tasks", "oal_tiny_mc"], ["no such folder"]
    if case == "run directory":
        run = tmp_path / "run"
        run.mkdir()
        (run / "config.json").write_text(json.dumps({"config": {}}))  # what `oal run` writes first
        return ["--model_args", f"pretrained={run}", "--tasks", "oal_tiny_mc"], ["run directory", "oal export"]
    if case == "unknown task":
        return ["--model_args", f"pretrained={art['merged']}", "--tasks", "no_such_task"], ["no_such_task"]
    import shutil

    broken = shutil.copytree(art["merged"], tmp_path / "broken")
    (broken / "config.json").write_text((broken / "config.json").read_text().replace("{", "{ ", 1))
    return ["--model_args", f"pretrained={broken}", "--tasks", "oal_tiny_mc"], ["config.json", "SHA256"]


@pytest.mark.parametrize("case", ["missing path", "run directory", "unknown task", "corrupted export"])
def test_bad_input_is_one_line_not_a_traceback(art, tmp_path, case):
    argv, words = _bad(art, tmp_path, case)
    env = {k: v for k, v in os.environ.items() if k != "OAL_DEBUG"}
    proc = subprocess.run([sys.executable, "-m", "oal.lm_eval", "--model", "hf", *argv, "--include_path",
                           str(art["tasks"]), "--limit", "1"], capture_output=True, text=True, timeout=600,
                          env={**env, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("Error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert all(w in lines[0] for w in words), lines[0]


@pytest.mark.parametrize("value, shown", [("", False), ("0", False), ("1", True), ("yes", True)])
def test_oal_debug_0_is_off_as_every_other_switch(monkeypatch, value, shown):
    from oal.lm_eval import show_traceback

    monkeypatch.setenv("OAL_DEBUG", value)
    assert show_traceback() is shown


def test_the_device_defaults_to_the_available_one(monkeypatch):
    from oal import lm_eval as entry

    seen = {}
    monkeypatch.setattr("lm_eval.__main__.cli_evaluate", lambda: seen.setdefault("argv", list(sys.argv)))
    entry.main(["--model", "hf", "--model_args", "pretrained=x", "--tasks", "x"])
    assert seen["argv"][-2:] == ["--device", "cuda" if torch.cuda.is_available() else "cpu"]
    seen.clear()
    entry.main(["--model", "hf", "--model_args", "pretrained=x", "--tasks", "x", "--device", "cpu"])
    assert seen["argv"].count("--device") == 1


def test_a_plain_model_folder_is_scored_not_called_a_run_directory(tmp_path):
    """The base (softmax) model's own folder has a config.json too: `python -m oal.lm_eval` refused it as "a run
    directory", so the base could not be scored beside its conversion."""
    from oal.lm_eval import _check_pretrained

    base = save_tiny_llama(tmp_path / "base")
    _check_pretrained(["--model", "hf", "--model_args", f"pretrained={base},dtype=float32"])  # no error
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"config": {}}))  # what `oal run` writes first
    with pytest.raises(ValueError, match="a run directory"):
        _check_pretrained(["--model_args", f"pretrained={run}"])


@pytest.mark.parametrize("name", ["converted/", "runs/a/converted"])
def test_a_missing_relative_folder_is_no_such_folder(tmp_path, monkeypatch, name):
    """`pretrained=converted/` (the docs' example) with no such folder: a path, not a hub id, so "no such folder"
    rather than huggingface_hub's "Repo id must use alphanumeric chars"."""
    from oal.lm_eval import _check_pretrained

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="no such folder"):
        _check_pretrained(["--model_args", f"pretrained={name}"])
    _check_pretrained(["--model_args", "pretrained=Qwen/Qwen2.5-0.5B"])  # a hub id is lm-eval's to resolve


def test_an_encoder_export_is_refused_in_one_short_line(tmp_path):
    """An encoder's export (model type oal_bert) has no causal LM for lm-eval to score: say so, instead of
    transformers' list of every config class AutoModelForCausalLM knows."""
    from oal.lm_eval import _check_pretrained

    folder = tmp_path / "enc"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "oal_bert"}))
    (folder / "oal.json").write_text("{}")
    with pytest.raises(ValueError, match="an encoder .*oal_bert.* causal") as exc:
        _check_pretrained(["--model_args", f"pretrained={folder}"])
    assert len(str(exc.value)) < 300
