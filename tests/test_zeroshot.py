"""Zero-shot PIQA / HellaSwag / ARC-E (App. F.3): data sources and their checks, prompt formats, batched scoring."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from transformers import ByT5Tokenizer, Qwen2Config, Qwen2ForCausalLM

from oal.data import zeroshot as zdata
from oal.evaluate.zeroshot import (
    Example,
    accuracies,
    evaluate_task,
    examples_from_rows,
    load_task,
    load_tasks,
    merge_metrics,
    score_candidates,
    score_examples,
)
from oal.rundir.hashes import sha256_file

FIXTURES = Path(__file__).parent / "fixtures" / "zeroshot"
TASK_FILES = {t: str(FIXTURES / f"{t}.jsonl") for t in zdata.TASKS}


def _rows(task):
    return [json.loads(line) for line in (FIXTURES / f"{task}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def model_and_tok():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return Qwen2ForCausalLM(cfg).eval(), ByT5Tokenizer()


# ----------------------------------------------------------------------------------------------- formats


@pytest.mark.parametrize("task", zdata.TASKS)
def test_fixtures_load_in_the_dataset_schema(task):
    examples, prov = load_task(task, task_file=TASK_FILES[task])
    rows = _rows(task)
    assert len(examples) == len(rows) >= 24
    assert prov["source"] == "task_file" and prov["sha256"] == sha256_file(TASK_FILES[task])
    assert prov["sha256_pinned"] is False and prov["rows"] == len(rows)
    n_cands = {"piqa": {2}, "hellaswag": {4}, "arc_easy": {3, 4}}[task]
    assert {len(e.candidates) for e in examples} == n_cands
    assert all(0 <= e.label < len(e.candidates) for e in examples)
    assert all(e.by_chars == (task == "arc_easy") for e in examples)
    limited, prov = load_task(task, task_file=TASK_FILES[task], limit=5)
    assert limited == examples[:5] and prov["limit"] == 5


def test_prompt_formats():
    (ex,) = load_task("piqa", task_file=TASK_FILES["piqa"], limit=1)[0]
    assert ex.context == "Question: To print a line of text in Python,\nAnswer:"
    assert ex.candidates[0] == "call print with the text as its argument." and ex.label == 0
    # HellaSwag: activity label, capitalised second segment, title markers -> periods, brackets removed
    rows = [{"activity_label": "Cooking", "ctx_a": "A man cuts onions.", "ctx_b": "he [title] then",
             "endings": ["fries them.", "sings [x] loudly.", "sleeps.", "runs."], "label": "0"}]
    (ex,) = examples_from_rows("hellaswag", rows)
    assert ex.context == "Cooking: A man cuts onions. He. then" and ex.candidates[1] == "sings loudly."
    # ARC: numeric answer keys index their own label list
    arc = [e for e in load_task("arc_easy", task_file=TASK_FILES["arc_easy"])[0] if e.candidates[0] == "8"]
    assert arc[0].context == "Question: What is the result of 2 ** 3?\nAnswer:" and arc[0].label == 0


def test_bad_rows_and_arguments(tmp_path):
    with pytest.raises(ValueError, match="^task"):
        load_task("mmlu", task_file=TASK_FILES["piqa"])
    with pytest.raises(ValueError, match="^task_file: no such file"):
        load_task("piqa", task_file=tmp_path / "missing.jsonl")
    for call in (lambda: load_task("piqa", task_file=tmp_path), lambda: zdata.parse_task_files([f"piqa={tmp_path}"])):
        with pytest.raises(ValueError, match=r"^task_file: .* \(piqa\) is a folder"):  # it said "no such file"
            call()
    bom = tmp_path / "bom.jsonl"  # as an editor saves it: its byte-order mark made line 1 "not JSON"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps({"goal": "g", "sol1": "a", "sol2": "b", "label": 1}).encode())
    assert load_task("piqa", task_file=bom)[0][0].label == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"goal": "g", "sol1": "a", "label": 0}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl: row 0 lacks columns \['sol2'\].*lighteval/piqa schema"):
        load_task("piqa", task_file=bad)
    bad.write_text(json.dumps({"goal": "g", "sol1": "a", "sol2": "b", "label": 2}) + "\n")
    with pytest.raises(ValueError, match="row 0 does not fit.*label 2 is out of range"):
        load_task("piqa", task_file=bad)
    bad.write_text(json.dumps({"question": "q", "choices": {"text": ["x"], "label": ["A"]}, "answerKey": "B"}) + "\n")
    with pytest.raises(ValueError, match="answerKey 'B'"):
        load_task("arc_easy", task_file=bad)
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        load_task("piqa", task_file=bad)
    specs = ((["piqa"], "TASK=PATH"), (["mmlu=x.jsonl"], "task"), ([f"piqa={tmp_path}/no.jsonl"], "no such"))
    for spec, match in specs:
        with pytest.raises(ValueError, match=match):
            zdata.parse_task_files(spec)
    assert zdata.parse_tasks("none") == [] and zdata.parse_tasks(None) == list(zdata.TASKS)
    with pytest.raises(ValueError, match="unknown task 'mmlu'"):
        zdata.parse_tasks("piqa,mmlu")
    with pytest.raises(ValueError, match="limit"):
        load_task("piqa", task_file=TASK_FILES["piqa"], limit=0)


# ----------------------------------------------------------------------------------------------- local folder


def _folder(tmp_path, pin_hashes: bool):
    """DIR/<task>/<file in repo> parquet files from the fixtures, and sources pinned to them (or unpinned)."""
    sources = {}
    for task, spec in zdata.SOURCES.items():
        path = tmp_path / task / spec.file
        path.parent.mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(_rows(task)), path)
        sources[task] = dataclasses.replace(spec, rows=len(_rows(task)),
                                            sha256=sha256_file(path) if pin_hashes else None)
    return sources


@pytest.mark.parametrize("pinned", [True, False])
def test_folder_verified_by_manifest(tmp_path, pinned):
    sources = _folder(tmp_path, pinned)
    zdata.write_manifest(tmp_path, sources=sources)
    for task in zdata.TASKS:
        examples, prov = load_task(task, data_dir=tmp_path, sources=sources)
        assert examples == load_task(task, task_file=TASK_FILES[task])[0]  # same rows as the JSON-lines fixture
        assert prov["source"] == "data_dir" and prov["revision"] == zdata.SOURCES[task].revision
        assert prov["sha256_pinned"] is pinned and prov["sha256"] == sha256_file(tmp_path / task / sources[task].file)
    # tampering: an unpinned file is caught by the recorded hash, a pinned one by the pin
    target = tmp_path / "piqa" / sources["piqa"].file
    pq.write_table(pa.Table.from_pylist(_rows("piqa")[:-1]), target)
    with pytest.raises(ValueError, match=f"SHA256 mismatch for {target}"):
        load_task("piqa", data_dir=tmp_path, sources=sources)


def test_folder_errors(tmp_path):
    sources = _folder(tmp_path, True)
    with pytest.raises(ValueError, match="has no manifest.json"):
        load_task("piqa", data_dir=tmp_path, sources=sources)
    zdata.write_manifest(tmp_path, sources=sources)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    (tmp_path / "hellaswag" / sources["hellaswag"].file).unlink()  # a missing split
    with pytest.raises(ValueError, match="missing .*hellaswag/data/validation-00000-of-00001.parquet"):
        load_task("hellaswag", data_dir=tmp_path, sources=sources)
    bad_rev = {**manifest, "tasks": {**manifest["tasks"], "piqa": {**manifest["tasks"]["piqa"], "revision": "0" * 40}}}
    (tmp_path / "manifest.json").write_text(json.dumps(bad_rev))
    with pytest.raises(ValueError, match="piqa revision is '0000"):
        load_task("piqa", data_dir=tmp_path, sources=sources)
    # a file with the pinned hash but the wrong row count, and one with wrong columns
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="30 rows, expected 31"):
        load_task("piqa", data_dir=tmp_path, sources={**sources, "piqa": dataclasses.replace(sources["piqa"], rows=31)})
    wrong = tmp_path / "arc_easy" / sources["arc_easy"].file
    pq.write_table(pa.table({"question": ["q"], "answer": ["A"]}), wrong)
    unpinned = {**sources, "arc_easy": dataclasses.replace(sources["arc_easy"], sha256=None)}
    zdata.write_manifest(tmp_path, ["arc_easy"], sources=unpinned)
    assert set(json.loads((tmp_path / "manifest.json").read_text())["tasks"]) == set(zdata.TASKS)  # others kept
    with pytest.raises(ValueError, match=r"lacks columns \['choices', 'answerKey'\].*allenai/ai2_arc schema"):
        load_task("arc_easy", data_dir=tmp_path, sources=unpinned)
    # write_manifest refuses a file that does not match a published pin
    with pytest.raises(ValueError, match="SHA256 mismatch.*the pinned allenai/ai2_arc"):
        zdata.write_manifest(tmp_path, ["arc_easy"], sources=sources)


def test_real_pins_are_recorded_or_marked_unknown():
    s = zdata.SOURCES
    assert (s["piqa"].rows, s["hellaswag"].rows, s["arc_easy"].rows) == (1838, 10042, 2376)  # App. F.3
    assert all(len(x.revision) == 40 for x in s.values())
    assert s["piqa"].sha256 is None  # not found published: verified against the recorded manifest instead
    assert all(len(s[t].sha256) == 64 for t in ("hellaswag", "arc_easy"))


# ----------------------------------------------------------------------------------------------- hub / offline


def test_offline_without_cache_is_skipped_with_one_clear_line(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    sets, skipped = load_tasks(["piqa", "arc_easy"], task_files={"arc_easy": TASK_FILES["arc_easy"]})
    assert list(sets) == ["arc_easy"] and list(skipped) == ["piqa"]
    line = skipped["piqa"]
    assert "\n" not in line and "offline" in line and "--zeroshot-dir" in line and "--task-file piqa=" in line
    with pytest.raises(zdata.DataUnavailable):
        zdata.fetch_task("hellaswag")


def test_hub_file_is_checked_against_the_pin(tmp_path, monkeypatch):
    import huggingface_hub

    path = tmp_path / "piqa.parquet"
    pq.write_table(pa.Table.from_pylist(_rows("piqa")), path)
    calls = []
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda *a, **kw: calls.append((a, kw)) or str(path))
    good = {"piqa": dataclasses.replace(zdata.SOURCES["piqa"], rows=30, sha256=sha256_file(path))}
    examples, prov = load_task("piqa", sources=good)
    assert len(examples) == 30 and prov["source"] == "hub" and prov["sha256_pinned"]
    (args, kw), = calls
    assert args == ("lighteval/piqa", "plain_text/validation-00000-of-00001.parquet")
    assert kw["revision"] == "41782e6bf0ef7de82a2ca8a9feb1dca042837fae" and kw["repo_type"] == "dataset"
    bad = {"piqa": dataclasses.replace(good["piqa"], sha256="0" * 64)}
    with pytest.raises(ValueError, match="SHA256 mismatch"):
        load_task("piqa", sources=bad)


# ----------------------------------------------------------------------------------------------- scoring


@pytest.mark.parametrize("by_chars", [False, True])
def test_scores_only_candidate_tokens(model_and_tok, by_chars):
    model, tok = model_and_tok
    ex = Example("Question: hi\nAnswer:", ["yes", "no way"], 0, by_chars=by_chars)
    got = score_candidates(model, tok, ex)
    ctx = tok(ex.context, add_special_tokens=False)["input_ids"]
    for cand, score in zip(ex.candidates, got, strict=True):
        cids = tok(" " + cand, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([ctx + cids])
        logp = F.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        ll = sum(logp[len(ctx) - 1 + i, c].item() for i, c in enumerate(cids))
        assert score == pytest.approx(ll / (len(cand) if by_chars else len(cids)), rel=1e-5)


def test_accuracies_follow_the_scores(model_and_tok):
    model, tok = model_and_tok
    exs = [Example("Q: a\nA:", ["x", "yy", "zzz"], i % 3, by_chars=i % 2 == 1) for i in range(6)]
    scores = score_examples(model, tok, exs)
    def hits(norm):  # % of examples whose best candidate under `norm` is the gold one
        best = [max(range(len(sc)), key=lambda j: norm(e, sc, j)) for e, sc in zip(exs, scores, strict=True)]
        return 100.0 * sum(b == e.label for b, e in zip(best, exs, strict=True)) / len(exs)

    got = evaluate_task(model, tok, exs)
    assert got == accuracies(exs, scores)
    assert got["acc"] == hits(lambda e, sc, j: sc[j][0])
    assert got["acc_norm"] == hits(lambda e, sc, j: sc[j][0] / (len(e.candidates[j]) if e.by_chars else sc[j][1]))
    assert got["acc_norm_lmeval"] == hits(lambda e, sc, j: sc[j][0] / len(e.candidates[j]))
    assert got["n"] == 6
    with pytest.raises(ValueError, match="^examples"):
        evaluate_task(model, tok, [])


@pytest.mark.parametrize("method", ["oal", "performer"])
def test_batched_right_padded_scores_equal_one_at_a_time(method):
    """The converted embedded model (OAL and a baseline), fp64: one padded batch == each sequence alone."""
    from oal.models.convert import convert
    from oal.models.registry import load_model

    model, tok, _ = load_model("default", dtype=torch.float64)
    model = convert(model, None, method).double()  # kernels in fp64 too
    exs = [e for t in zdata.TASKS for e in load_task(t, task_file=TASK_FILES[t], limit=3)[0]]
    batched = score_examples(model, tok, exs, batch_size=7)  # ragged lengths: every batch is right-padded
    single = score_examples(model, tok, exs, batch_size=1)
    assert [[n for _, n in s] for s in batched] == [[n for _, n in s] for s in single]
    flat = lambda scores: [ll for s in scores for ll, _ in s]  # noqa: E731
    worst = max(abs(a - b) for a, b in zip(flat(batched), flat(single), strict=True))
    assert worst < 1e-9, worst


def test_merge_metrics_layout():
    m = merge_metrics({}, "oal", {"piqa": {"acc": 50.0, "acc_norm": 60.0, "acc_norm_lmeval": 55.0, "n": 4}},
                      {"piqa": {"source": "task_file"}}, {"hellaswag": "offline"})
    assert m["zeroshot"]["oal"]["piqa"]["n"] == 4 and m["zeroshot_skipped"] == {"hellaswag": "offline"}
    merge_metrics(m, "oal", {"hellaswag": {"acc": 1.0, "acc_norm": 1.0, "acc_norm_lmeval": 1.0, "n": 2}}, {}, {})
    assert "zeroshot_skipped" not in m and set(m["zeroshot"]["oal"]) == {"piqa", "hellaswag"}
