"""Encoder audit: the folder's own sentence pooling (sentence-transformers' modes, measured as it computes them), a
damaged pooling config, the report's cosines against metrics.json (one seed and several), app-b-pairs on an encoder,
pooling precision of a bf16 encoder."""

import dataclasses
import json
import re

import pytest
import torch
from _tiny_encoders import save_tiny_encoder, save_word_corpus, tiny_encoder
from rich.console import Console
from test_encoder_pipeline import WORDS, _cfg, _plan

from oal.evaluate.embedding import SENTENCE_POOLINGS, embedding_similarity, pool, sentence_embeddings
from oal.models.encoder import POOLING_MODES, load_encoder, sentence_pooling
from oal.pipeline.runs import run_seed


def _declare(folder, modes, where="1_Pooling"):
    """A sentence-transformers Pooling module in `folder/where` with `modes` switched on."""
    (folder / where).mkdir(parents=True, exist_ok=True)
    cfg = {"word_embedding_dimension": 32, **{f"pooling_mode_{k}": m in modes for m, k in POOLING_MODES.items()}}
    (folder / where / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny BERT folder that declares max pooling, as some sentence-transformers checkpoints do, and a corpus."""
    root = tmp_path_factory.mktemp("audit_assets")
    save_tiny_encoder(root / "model", WORDS)
    _declare(root / "model", ["max"])
    save_word_corpus(root / "corpus.txt", WORDS)
    return root


@pytest.fixture(scope="module")
def max_run(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("audit_run")
    return out, run_seed(_cfg(assets), out, progress=False)


def _st_pool(hidden, mask, mode):
    """sentence-transformers' Pooling.forward for one mode, written out per row in float64."""
    rows = []
    for h, m in zip(hidden.double(), mask, strict=True):
        real = m.bool()
        if mode == "cls":
            rows.append(h[0])
        elif mode == "max":
            rows.append(h[real].max(0).values)
        elif mode == "mean":
            rows.append(h[real].mean(0))
        elif mode == "mean_sqrt_len":
            rows.append(h[real].sum(0) / real.sum().double().sqrt())
        elif mode == "weightedmean":
            w = torch.arange(1, len(m) + 1, dtype=torch.float64)[real]
            rows.append((h[real] * w[:, None]).sum(0) / w.sum())
        elif mode == "lasttoken":
            rows.append(h[real.nonzero().max()])
    return torch.stack(rows)


@pytest.mark.parametrize("mode", SENTENCE_POOLINGS)
def test_every_sentence_transformers_pooling_is_read_and_computed_as_it_does(tmp_path, mode):
    """A folder declaring max, weighted-mean or last-token pooling was recorded as declaring none (and measured
    with mean and [CLS] only): each mode is read from the Pooling config and pooled as sentence-transformers
    pools, padded tokens left out (right and left padding)."""
    _declare(tmp_path, [mode])
    assert sentence_pooling(tmp_path) == mode
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 5, generator=g, dtype=torch.float64) - 2.0  # all negative: max must skip padding
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [0] * 2 + [1] * 5])
    torch.testing.assert_close(pool(hidden, mask, mode), _st_pool(hidden, mask, mode), rtol=1e-12, atol=1e-12)


def test_several_modes_concatenate_and_modules_json_places_the_pooling(tmp_path):
    _declare(tmp_path, ["mean", "cls"], where="2_Pool")
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
         {"idx": 1, "name": "1", "path": "2_Pool", "type": "sentence_transformers.models.Pooling"}]))
    assert sentence_pooling(tmp_path) == "cls+mean"  # sentence-transformers' order: cls before mean
    hidden, mask = torch.randn(2, 5, 3, dtype=torch.float64), torch.tensor([[1, 1, 1, 0, 0], [1] * 5])
    torch.testing.assert_close(pool(hidden, mask, "cls+mean"),
                               torch.cat([_st_pool(hidden, mask, "cls"), _st_pool(hidden, mask, "mean")], -1))


def test_a_damaged_pooling_config_is_an_error_naming_it(tmp_path):
    save_tiny_encoder(tmp_path / "model", WORDS)
    (tmp_path / "model" / "1_Pooling").mkdir()
    bad = tmp_path / "model" / "1_Pooling" / "config.json"
    bad.write_text('{"pooling_mode_mean_tokens": tru')
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        load_encoder(tmp_path / "model")


def test_an_encoder_run_measures_the_folders_own_pooling(max_run, assets):
    """The run reports the cosine of the pooling the model declares (max here), and the number reproduces from
    the run's kernels on the base encoder."""
    import oal
    from oal.data import load_corpus
    from oal.data.passages import PassagePlan, plan_passages, tokenize_passages
    out, metrics = max_run
    assert metrics["pooling"] == "max" and set(metrics["embedding"]["oal"]) == {"mean", "cls", "max"}
    base, tok, _ = load_encoder(assets / "model")
    held = tokenize_passages(tok, plan_passages(load_corpus(str(assets / "corpus.txt")),
                                                PassagePlan.from_dict(_plan()))["heldout"], 64)
    sim = embedding_similarity(base, oal.load(out, load_encoder(assets / "model")[0]), held, batch_size=8,
                               poolings=("max",))
    assert sim["max"]["mean"] == pytest.approx(metrics["embedding"]["oal"]["max"]["mean"], rel=1e-12)
    assert sim["max"]["mean"] < 1.0
    assert "max pooling (the model's own)" in (out / "report.md").read_text()


def _report_cosines(report: str) -> dict:
    """{(method row, column): (mean, min)} of the report's embedding table."""
    table = report.split("## Embedding agreement")[1].split("\n\n")[2].splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    out = {}
    for row in table[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for col, cell in zip(header[1:], cells[1:], strict=True):
            mean, low = (float(x.split("±")[0]) for x in cell.split(" / "))
            out[cells[0], col] = (mean, low)
    return out


def _close(printed: float, true: float) -> bool:
    """`printed` carries three significant digits of 1 - `true`."""
    return abs(printed - true) <= 0.006 * max(1.0 - true, 1e-10)


def test_report_and_terminal_cosines_carry_the_json_numbers(max_run):
    """Converted layers leave cosines near 1 (0.999999 on this model): the report printed 1.00000 for every method
    and pooling, and the terminal too, so no method could be told from another."""
    from oal.pipeline.encoder import summary_table

    out, metrics = max_run
    emb = metrics["embedding"]
    printed = _report_cosines((out / "report.md").read_text())
    names = {"oal": "OAL", "global": "Learned global"}
    labels = {"mean": "mean pooling", "cls": "first token ([CLS])", "max": "max pooling (the model's own)"}
    assert len(printed) == 6
    for m, name in names.items():
        for p, label in labels.items():
            mean, low = printed[name, f"cosine, {label} (mean / min)"]
            assert _close(mean, emb[m][p]["mean"]) and _close(low, emb[m][p]["min"]), (m, p, mean, low, emb[m][p])
    console = Console(width=80, record=True)
    console.print(summary_table(metrics))
    rows = {ln.split("│")[1].strip(): ln for ln in console.export_text().splitlines() if ln.count("│") > 2}
    for m in names:
        cells = [c.strip() for c in rows[m].split("│")[1:-1]]
        dist = [float(c) for c in cells[3:]]  # 1 - cos: mean, [CLS], max (own), worst mean-pooled passage
        want = [1 - emb[m][p]["mean"] for p in ("mean", "cls", "max")] + [1 - emb[m]["mean"]["min"]]
        assert dist == pytest.approx(want, rel=0.006), (m, cells, want)


def test_the_report_of_several_seeds_gives_the_spread_of_its_cosines(tmp_path):
    """metrics.json of several seeds holds each cosine's sample std over seeds; the report gave the mean alone."""
    from oal.pipeline.encoder import EncoderRun
    from oal.pipeline.encoder_report import write_encoder_report

    def seed(cos):
        return {"model": "m", "methods": ["oal"], "converted_layers": [1], "fidelity": {}, "pooling": None,
                "perplexity": {}, "perplexity_no_adapt": {}, "elapsed_s": {"embedding": 1.0},
                "embedding": {"oal": {"mean": {"mean": cos, "min": cos - 1e-6}, "cls": {"mean": cos, "min": cos}}}}

    metrics = EncoderRun.aggregate({1: seed(0.9999990), 2: seed(0.9999970)})
    metrics["seeds"] = [1, 2]
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    report = write_encoder_report(tmp_path).read_text()
    std = metrics["embedding_std"]["oal"]["mean"]["mean"]
    assert std == pytest.approx(2e-6 / 2**0.5, rel=1e-6)  # sample std of two values 2e-6 apart
    printed = _report_cosines(report)
    for p, low in (("mean pooling", 0.9999960), ("first token ([CLS])", 0.9999970)):
        mean, got_low = printed["OAL", f"cosine, {p} (mean / min)"]
        assert _close(mean, 0.9999980) and _close(got_low, low), (p, mean, got_low)
    spreads = [float(x) for x in re.findall(r"± (\S+) /", report)]
    assert spreads == pytest.approx([std, std], rel=0.06), report


def test_app_b_pairs_on_an_encoder_is_refused_before_anything_is_written(assets, tmp_path):
    """RoPE's rotation pairs do not exist in a BERT-family encoder (absolute positions): the run went ahead and
    reported pair-tied groups."""
    from oal.errors import InputError

    with pytest.raises(InputError, match="no RoPE") as err:
        cfg = _cfg(assets)
        run_seed(dataclasses.replace(cfg, grouping={**cfg.grouping, "pairs": True}), tmp_path / "run", progress=False)
    assert err.value.param == "--grouping"
    assert not (tmp_path / "run").exists()


def test_a_bf16_encoders_embeddings_are_pooled_in_float64():
    """bf16 hidden states were pooled in bf16 (the mean's sum rounded to 8 bits) before the cosine; the pooled
    embedding is now the float64 pooling of the model's own output."""
    model = tiny_encoder("bert").to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 60, (3, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0
    got = sentence_embeddings(model, {"input_ids": ids, "attention_mask": mask})
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state.double()
    for p in ("mean", "cls"):
        torch.testing.assert_close(got[p], _st_pool(hidden, mask, p), rtol=1e-12, atol=1e-12)


def test_a_setting_no_encoder_stage_reads_resumes_the_run(max_run, assets, tmp_path):
    """`oal run --steps 3` (adaptation, which encoders do not run) then `oal run` on the same directory: the second
    was refused as another configuration, and --force would have recomputed every stage."""
    import shutil

    out, metrics = max_run
    shutil.copytree(out, tmp_path / "run")
    stamp = (tmp_path / "run" / "kernels.safetensors").stat().st_mtime_ns
    cfg = _cfg(assets)
    again = run_seed(dataclasses.replace(cfg, adapt={**cfg.adapt, "steps": 3}, eval_batch_size=2), tmp_path / "run",
                     progress=False)
    assert (tmp_path / "run" / "kernels.safetensors").stat().st_mtime_ns == stamp, "calibration was recomputed"
    assert again["embedding"] == metrics["embedding"] and again["fidelity"] == metrics["fidelity"]
