"""The benchmarks as a user's tools, audited: the figure beside a JSON is the one a reader redraws from that JSON,
the headline competitor is what users would otherwise run, an output name cannot swallow its own figure, every JSON
records the arguments it ran with, and a run cut short says so in what it leaves. Tiny sizes, no timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _json_roundtrip(obj):
    """`obj` as a reader gets it back from the file: atomic_write_json sorts keys, and JSON keys are strings."""
    import tempfile

    from oal.rundir.files import atomic_write_json, load_json

    with tempfile.TemporaryDirectory() as tmp:
        atomic_write_json(Path(tmp) / "r.json", obj)
        return load_json(Path(tmp) / "r.json")


def _decode_record():
    rows = [{"context": c, "ms_per_token": c / 1000 * (i + 1), "cache_bytes": c * 2**10 * (3 - i),
             "cache_bytes_per_layer": {0: c}} for i, c in enumerate((1024, 4096, 32768))]
    record = {"variants": {v: [r | {"ms_per_token": r["ms_per_token"] * (j + 1)} for r in rows]
                           for j, v in enumerate(("softmax", "oal", "oal-all"))}, "source": "stub"}
    return {"default": record}


def _recall_result():
    lengths, pairs = ("64", "128", "256", "512"), ("2", "4", "8", "16")
    arms = ("softmax", "oal", "global", "swa", "oal-swa", "global-swa")
    return {"trained_length": 64, "eval_pairs": 8,
            "accuracy": {a: {n: 1.0 - 0.1 * i * j for j, n in enumerate(lengths)} for i, a in enumerate(arms)},
            "accuracy_by_pairs": {a: {p: 1.0 - 0.05 * i * j for j, p in enumerate(pairs)} for i, a in enumerate(arms)},
            "state_bytes": {a: {n: 1024 * (i + 1) * (j + 1) for j, n in enumerate(lengths)}
                            for i, a in enumerate(arms)}}


def _cost_result():
    def shape(k):
        stages = [{"stage": s, "seconds": {"H200": k * (i + 1), "A100": 2 * k * (i + 1)}}
                  for i, s in enumerate(("capture", "calibrate", "adapt oal"))]
        return {"stages": stages, "total_s": {g: sum(r["seconds"][g] for r in stages) for g in ("H200", "A100")},
                "peak_gb": 10.0 * k}

    return {"shapes": {"qwen2.5-0.5b": shape(1), "llama-3.2-1b": shape(2), "llama-3.1-8b": shape(8)}}


def _memory_results():
    phases = {p: {"rss_gb": 1.0 + i, "peak_above_start_gb": 0.1 * i, "seconds": 1.0}
              for i, p in enumerate(("build", "convert", "forward + loss", "backward", "optimizer step",
                                     "validation block"))}
    return {"shape": "qwen2.5-0.5b", "layers": 1, "seq_len": 64, "loss": "chunked", "peak_rss_gb": 6.0,
            "goal_gb": None, "phases": phases}


def _settings_ab_result():
    names = {"tuned": "64x2 pipeline", "64x4,serial": "64x4 serial", "32x2,pipeline": "32x2 pipeline"}
    return {"settings": names, "rounds": 1, "n": 64, "dtype": "float32", "cpu": {"model": "cpu"}, "threads": 1,
            "median": {c: {nm: 1.0 + i + 0.5 * k for i, nm in enumerate(names)}
                       for k, c in enumerate(("quiet", "loaded"))}}


def _encoder_result():
    cos = lambda x: {"mean": 1 - x, "min": 1 - 2 * x, "p05": 1 - 1.5 * x}  # noqa: E731
    return {"model": "/m/tiny-bert", "layers": [1, 2], "passages": 3,
            "methods": {m: {"relmse": 0.1 * (i + 1), "relmse_post_o": 0.12 * (i + 1), "mse": 0.01,
                            "per_layer_relmse": {"1": 0.1, "2": 0.2}, "cosine": {"mean": cos(1e-4 * (i + 1)),
                                                                                 "cls": cos(2e-4 * (i + 1))}}
                        for i, m in enumerate(("taylor", "oal", "global"))}}


FIGURES = {  # module: (its figure function as the module calls it, data as the module holds it in memory)
    "decode": (lambda m, data, path: m.plot(data, path), _decode_record),
    "recall": (lambda m, data, path: m.figure(data, path), _recall_result),
    "cost_model": (lambda m, data, path: m.figure(data, path), _cost_result),
    "memory": (lambda m, data, path: m._figure([data], path), _memory_results),
    "settings_ab": (lambda m, data, path: m._plot(data, path), _settings_ab_result),
    "encoder": (lambda m, data, path: m.plot(data, path), _encoder_result),
}


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_the_figure_is_the_one_redrawn_from_the_json(tmp_path, name):
    """A figure drawn from the data in memory and one drawn from the JSON it was written to are the same picture.
    The JSON's keys come back sorted (and as strings): decode's variants changed colours, recall's lengths came back
    as "128", "256", "512", "64" (a zig-zag line), cost_model's panels and memory's phases changed order."""
    import importlib

    module = importlib.import_module(f"benchmarks.{name}")
    draw, make = FIGURES[name]
    draw(module, make(), tmp_path / "memory.png")
    draw(module, _json_roundtrip(make()), tmp_path / "json.png")
    assert (tmp_path / "memory.png").read_bytes() == (tmp_path / "json.png").read_bytes()


def test_methods_ratios_are_against_torchs_default_sdpa(tmp_path, monkeypatch):
    """benchmarks.methods called its `softmax` row "SDPA" and divided by it: the registry's softmax method, which
    reads q, k and v for NaN before it calls SDPA. The competitor is torch's default dispatch, called as HF calls it."""
    import torch
    import torch.nn.functional as F

    import oal.methods.softmax as softmax
    from benchmarks import methods

    calls, checked = [], []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    monkeypatch.setattr(softmax, "max_abs", lambda name, t: checked.append(name))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 8, 64, generator=gen) for h in (14, 2, 2))
    out = methods._build("sdpa")(q, k, v, causal=True)
    assert calls == [{"is_causal": True, "enable_gqa": True}] and checked == []
    torch.testing.assert_close(out, methods._build("softmax")(q, k, v, causal=True))

    times = iter(range(1, 100))
    monkeypatch.setattr(methods, "_time", lambda fn, repeats: float(next(times)))
    out_json = tmp_path / "m.json"
    methods.main(methods.parse_args(["--lens", "8", "16", "--repeats", "2", "--out", str(out_json)]))
    rows = json.loads(out_json.read_text())["rows"]
    for r in rows:
        sdpa = next(s for s in rows if s["method"] == "sdpa" and s["N"] == r["N"])
        assert r["ratio_to_sdpa"] == pytest.approx(r["ms"] / sdpa["ms"])
    assert {r["method"] for r in rows} >= {"sdpa", "softmax", "oal"}
    assert [r["ratio_to_sdpa"] for r in rows if r["method"] == "softmax"] != [1.0, 1.0]


def test_an_output_named_png_is_refused(tmp_path):
    """`methods --out res.png` wrote its JSON there and then the figure over it (NAME.png beside NAME): the JSON was
    lost, and the command said nothing."""
    from benchmarks._common import output_file

    with pytest.raises(Exception, match="PNG"):
        output_file(str(tmp_path / "res.png"))
    res = subprocess.run([sys.executable, "-m", "benchmarks.methods", "--out", str(tmp_path / "res.PNG")],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 2 and res.stderr.startswith("Error: argument --out:") and "PNG" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not list(tmp_path.iterdir())


def test_every_json_records_the_arguments_it_ran_with(tmp_path, monkeypatch):
    """window, methods, capture, grouping, calibration and decode recorded some of their arguments (or none: the
    --repeats of a best-of or median) in their JSON; `environment()` now records the tool's parsed arguments."""
    from benchmarks import window
    from benchmarks._common import environment

    out = tmp_path / "w.json"
    window.main(window.parse_args(["--lengths", "16", "--repeats", "2", "--out", str(out)]))
    args = json.loads(out.read_text())["environment"]["args"]
    assert args["repeats"] == 2 and args["lengths"] == [16] and args["out"] == str(out)
    from benchmarks import operator

    operator.parse_args(["--lengths", "64,128", "--no-tune", "--dtypes", "float32"])
    assert environment()["args"]["lengths"] == [64, 128] and environment()["args"]["no_tune"] is True


def test_model_cut_short_leaves_a_partial_json_that_says_what_it_measured_with(tmp_path, monkeypatch):
    """benchmarks.model rewrites its JSON after every length "so partial results survive": those writes held the
    rows alone, without the dtype, clock, versions, machine or arguments they were measured with."""
    from benchmarks import model

    row = {"model": "qwen", "variant": "softmax", "length": 64, "prefill_s": 1.0, "decode_ms": 2.0, "cache_mib": 1.0,
           "load_before": 0.0, "composed": False}
    answers = iter([row])

    def child(cmd, what):
        try:
            return dict(next(answers))
        except StopIteration:
            raise KeyboardInterrupt from None  # Ctrl-C during the second child

    monkeypatch.setattr(model.bench, "child_json", child)
    out = tmp_path / "model.json"
    with pytest.raises(KeyboardInterrupt):
        model.main(model.parse_args(["--models", "qwen", "--lengths", "64", "--dtype", "bfloat16", "--out",
                                     str(out)]))
    record = json.loads(out.read_text())
    assert record["complete"] is False and [r["variant"] for r in record["rows"]] == ["softmax"]
    assert record["dtype"] == "bfloat16" and record["clock"] == "wall"
    assert record["environment"]["args"]["lengths"] == [64] and record["environment"]["versions"]["torch"]


def test_decode_host_cut_short_says_its_json_is_partial(tmp_path, monkeypatch):
    """decode_host rewrites its JSON after each part (for a time limit); one cut short looked like a finished run
    of fewer methods, and with `prefill` null like a run with --prefill-n 0."""
    from benchmarks import decode_host

    def measure(method, args, device, direct=False):
        if method == "swa":
            raise KeyboardInterrupt  # the time limit's SIGINT, during the second method
        return {"method": method, "softmax_us": 1.0, "converted_us": 2.0, "difference_us": 1.0}

    monkeypatch.setattr(decode_host, "measure", measure)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # main sets it for the CPU stand-in: restored after the test
    out = tmp_path / "h.json"
    argv = ["--device", "cpu", "--steps", "5", "--warmup", "1", "--prefill-n", "0", "--out", str(out)]
    with pytest.raises(KeyboardInterrupt):
        decode_host.main(decode_host.parse_args([*argv, "--methods", "oal,swa"]))
    record = json.loads(out.read_text())
    assert record["complete"] is False and [r["method"] for r in record["rows"]] == ["oal"]
    assert decode_host.main(decode_host.parse_args([*argv, "--methods", "oal"])) == 0
    assert json.loads(out.read_text())["complete"] is True


ENCODER_WORDS = ["alpha", "beta", "gamma", "delta", "kernel", "query", "key", "value", "head", "group", "token"]


def test_encoder_json_names_the_run_it_read_and_has_its_figure(tmp_path):
    """benchmarks.encoder's JSON did not say which run directory it read, nor which config and kernels (their
    SHA256), and it wrote no PNG: a number could not be traced to the kernels that gave it."""
    from _tiny_encoders import save_tiny_encoder, save_word_corpus
    from safetensors.torch import load_file, save_file

    from benchmarks import encoder
    from oal.pipeline.config import RunConfig
    from oal.pipeline.runs import run
    from oal.rundir.files import load_json
    from oal.rundir.hashes import sha256_file

    save_tiny_encoder(tmp_path / "model", ENCODER_WORDS)
    save_word_corpus(tmp_path / "corpus.txt", ENCODER_WORDS, paragraphs=200)
    plan = {"grouping": {"split": "train", "start": 0, "count": 6},
            "calib_train": {"split": "train", "start": 6, "count": 4},
            "calib_val": {"split": "train", "start": 10, "count": 2},
            "heldout": {"split": "test", "start": 0, "count": 3}, "max_len": 32}
    cfg = RunConfig(model=str(tmp_path / "model"), data=str(tmp_path / "corpus.txt"), plan=plan,
                    methods=["oal", "global"], grouping={"n_bootstrap": 5},
                    calib={"max_steps": 3, "val_every": 2, "patience": 4})
    run(cfg, tmp_path / "run", progress=False)
    out = tmp_path / "res" / "enc.json"
    encoder.main(encoder.parse_args([str(tmp_path / "run"), "--out", str(out)]))
    record = load_json(out)
    files = ("config.json", "kernels.json", "kernels.safetensors", "kernels/global/kernels.json",
             "kernels/global/kernels.safetensors")
    assert record["run"]["dir"] == str((tmp_path / "run").resolve())
    assert record["run"]["sha256"] == {f: sha256_file(tmp_path / "run" / f) for f in files}
    assert set(record["methods"]) == {"taylor", "oal", "global"}
    encoder.plot(record, tmp_path / "redrawn.png")
    assert out.with_suffix(".png").read_bytes() == (tmp_path / "redrawn.png").read_bytes()
    hashed = record["base_model"]["sha256"]
    assert "model.safetensors" in hashed and hashed == {f: sha256_file(tmp_path / "model" / f) for f in hashed}
    # the encoder folder changed since the run: it loaded it again and compared the old kernels with another model
    weights = tmp_path / "model" / "model.safetensors"
    tensors = load_file(weights)
    name = next(k for k, t in tensors.items() if t.is_floating_point() and t.ndim == 2)
    save_file({**tensors, name: tensors[name] * 1.5}, weights)
    with pytest.raises(ValueError, match="base_model: the weights of .* differ from the base model recorded"):
        encoder.main(encoder.parse_args([str(tmp_path / "run"), "--out", str(tmp_path / "res" / "again.json")]))
    assert not (tmp_path / "res" / "again.json").exists()


def _decode_stubs(monkeypatch, seen):
    from benchmarks import decode

    def variant(name, shape="default", max_pos=decode.MAX_POS):
        seen.setdefault("max_pos", set()).add(max_pos)
        return object(), "stub"

    monkeypatch.setattr(decode, "variant", variant)
    monkeypatch.setattr(decode, "decode_time", lambda model, ctx, tokens: (1e-6 * ctx, {0: 2 * ctx, 1: ctx}))
    return decode


def test_decode_writes_its_out_at_the_lengths_asked(tmp_path, monkeypatch):
    """benchmarks.decode had no --out (it always wrote benchmarks/results/decode.json) and no smoke size: its
    contexts were 1k, 4k, 32k or, with --full, 1k..32k."""
    seen = {}
    decode = _decode_stubs(monkeypatch, seen)
    default = decode.RESULTS / "decode.json"
    before = default.stat().st_mtime_ns if default.exists() else None
    out = tmp_path / "d.json"
    decode.main(decode.parse_args(["--shape", "default", "--lengths", "128,64", "--tokens", "1", "--out", str(out)]))
    record = json.loads(out.read_text())
    assert record["contexts"] == [64, 128] and record["environment"]["args"]["out"] == str(out)
    assert [r["context"] for r in record["shapes"]["default"]["variants"]["oal"]] == [64, 128]
    assert out.with_suffix(".png").stat().st_size > 0
    assert (default.stat().st_mtime_ns if default.exists() else None) == before
    assert decode.parse_args([]).lengths is None  # the default contexts stay those of before
    decode.main(decode.parse_args(["--shape", "default", "--lengths", "65536", "--tokens", "3", "--out", str(out)]))
    assert seen["max_pos"] == {decode.MAX_POS, 65536 + 3 + 2}  # RoPE's positions cover the longest context
    with pytest.raises(SystemExit):
        decode.parse_args(["--lengths", "64", "--full"])


def _budget_stubs(tmp_path, monkeypatch):
    from benchmarks import _budget_study

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")
    monkeypatch.setattr(_budget_study, "collect", lambda runs, tables, device: {"budgets": {}, "device": "stub"})
    monkeypatch.setattr(_budget_study, "plot", lambda data, path: Path(path).write_bytes(b"figure"))
    monkeypatch.setattr(_budget_study, "markdown", lambda data: "table")
    return ["collect", "--runs", str(tmp_path / "run")]


def test_budget_collect_records_its_environment(tmp_path, monkeypatch):
    """`benchmarks.budget collect` wrote no `environment` (versions, commit, machine, arguments): only the command."""
    from benchmarks import budget

    argv = _budget_stubs(tmp_path, monkeypatch)
    out = tmp_path / "study.json"
    assert budget.main([*argv, "--json", str(out)]) == 0
    env = json.loads(out.read_text())["environment"]
    assert env["args"]["json"] == str(out) and env["args"]["runs"] == [str(tmp_path / "run")]
    assert env["versions"]["torch"] and "machine" in env
    assert out.with_suffix(".png").read_bytes() == b"figure"


def test_budget_collect_checks_its_outputs_first(tmp_path, monkeypatch, capsys):
    """`collect --json x.png` wrote the JSON and then the figure over it (the default --png is beside the JSON under
    its name); an unwritable --json was found only at the write, after the records were read, as a traceback."""
    from benchmarks import budget

    argv = _budget_stubs(tmp_path, monkeypatch)
    read = []
    monkeypatch.setattr("benchmarks._budget_study.collect", lambda *a: read.append(a) or {"device": "stub"})
    for outputs, option in ((["--json", str(tmp_path / "x.png")], "--json"),
                            (["--json", "/proc/no-such-folder/x.json"], "--json"),  # root may write anywhere else
                            (["--json", str(tmp_path / "a.json"), "--png", "/proc/no-such-folder/a.png"], "--png")):
        assert budget.main([*argv, *outputs]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"Error: {option}:"), err
    assert read == [] and not list(tmp_path.glob("*.png"))


def test_budget_collect_a_failed_write_is_one_line(tmp_path, monkeypatch, capsys):
    """A --json that could not be written once the work was done (a full disk) ended `collect` in a traceback:
    main caught only its usage errors and the library's input errors."""
    import errno

    from benchmarks import budget
    from oal.rundir import files

    argv = _budget_stubs(tmp_path, monkeypatch)

    def full(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(files, "atomic_write_json", full)
    assert budget.main([*argv, "--json", str(tmp_path / "s.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("Error: --json:") and "No space left" in err[0], err


def test_memory_compare_full_marks_its_first_json_partial(tmp_path, monkeypatch):
    """With --compare-full, memory writes its JSON before the (long) full-logits child: that copy had
    `compared: {}` and nothing saying the comparison was still to come (it read as a run without --compare-full)."""
    from benchmarks import memory

    def child(args, loss):
        if loss == "full" and calls.pop(0) == "interrupt":
            raise KeyboardInterrupt  # the full-logits child cut short
        return _memory_results() | {"loss": loss, "dtype": "float32"}

    out = tmp_path / "m.json"
    argv = ["--layers", "1", "--seq-len", "64", "--json", str(out)]
    monkeypatch.setattr(memory, "_child", child)
    calls = ["interrupt"]
    with pytest.raises(KeyboardInterrupt):
        memory.main(memory.parse_args([*argv, "--compare-full"]))
    record = json.loads(out.read_text())
    assert record["complete"] is False and record["compared"] == {}
    calls = ["finish"]
    memory.main(memory.parse_args([*argv, "--compare-full"]))
    record = json.loads(out.read_text())
    assert record["complete"] is True and set(record["compared"]) == {"full"}
    memory.main(memory.parse_args(argv))
    assert json.loads(out.read_text())["complete"] is True
