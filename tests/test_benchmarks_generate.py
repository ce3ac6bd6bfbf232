"""benchmarks.generate and its long-context caches, at tiny sizes on the CPU (the GPU run is scripts/gpu_perf.sh)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks import _long_context as lc
from benchmarks import generate
from oal.models.cache import OALStateLayer
from oal.ops.window import split_window_state

# SmolLM2-135M's layer count (the recipe's layer indices need 30) at a tiny width
TINY = (LlamaConfig, LlamaForCausalLM, dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=30,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8))


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(lc.SHAPES, "smollm2-135m", TINY)


def test_long_cache_holds_real_windows_and_states(tiny):
    model, source = lc.build("smollm2-135m", max_positions=4096)
    assert "max_position_embeddings raised to 4096" in source
    layers = generate.convert(model, "smollm2-135m", "oal-swa")
    assert layers == generate.RECIPE_LAYERS["smollm2-135m"]
    cache = lc.long_cache(model, context=3000, batch=3, prompt=100)
    for i, layer in enumerate(cache.layers):
        if i in layers:
            assert isinstance(layer, OALStateLayer) and layer.seen == 3000 and layer.state.shape[0] == 3
            slots, prefix = split_window_state(layer.state, 8, 8, window=64, sinks=4, kernel=True)
            assert bool((slots[..., -1] == 1).all()), "the sinks and the window are filled by the real prompt"
            assert float(prefix[..., 0, -1].min()) == 100 - 64 - 4  # the prompt's older keys, in the prefix
            torch.testing.assert_close(layer.state[0], layer.state[2])  # one prompt, repeated over the batch
        else:
            assert layer.keys.shape == (3, 2, 3000, 8)
    got = lc.decode(model, cache, context=3000, tokens=2, warmup=1)
    assert len(got["step_s"]) == 2 and got["tokens_per_s"] > 0
    assert cache.get_seq_length() == 3003


def test_a_tiny_run_writes_the_issue_rows(tiny, tmp_path):
    out = tmp_path / "gen.json"
    generate.main(["--device", "cpu", "--shapes", "smollm2-135m", "--contexts", "200", "--batches", "1,2",
                   "--tokens", "2", "--warmup", "1", "--prompt", "80", "--out", str(out)])
    record = json.loads(out.read_text())
    rows = record["rows"]
    assert [(r["method"], r["batch"]) for r in rows] == [(m, b) for m in generate.METHODS for b in (1, 2)]
    for r in rows:
        assert isinstance(r["shape"], str) and isinstance(r["context"], int) and isinstance(r["batch"], int)
        assert isinstance(r["tokens_per_s"], float) and isinstance(r["peak_mib"], float)
    assert {s["method"] for s in record["speedups"]} == {"oal", "oal-swa"}
    assert out.with_suffix(".png").exists()


def test_rows_go_context_first_and_a_row_that_raises_is_kept_with_its_error(tiny, tmp_path, monkeypatch):
    """The first context given comes first for every shape and method (a time limit cuts the later ones), and a
    run that raises (not out of memory) is a row with the error in `skipped`; the other rows are measured."""
    real = generate.run

    def run(model, context, batch, args):
        if context == 200 and any(getattr(m, "oal_method", None) for m in model.modules()):
            raise IndexError("tuple index out of range")
        return real(model, context, batch, args)

    monkeypatch.setattr(generate, "run", run)
    out = tmp_path / "gen.json"
    generate.main(["--device", "cpu", "--shapes", "smollm2-135m", "--contexts", "200,100", "--methods",
                   "softmax,oal", "--tokens", "2", "--warmup", "1", "--prompt", "80", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["context"], r["method"]) for r in rows] == [(200, "softmax"), (200, "oal"), (100, "softmax"),
                                                           (100, "oal")]
    assert rows[1]["skipped"] == "IndexError: tuple index out of range" and rows[1]["tokens_per_s"] is None
    assert all(isinstance(rows[i]["tokens_per_s"], float) for i in (0, 2, 3))


@pytest.mark.parametrize("argv,message", [
    (["--contexts", "8k"], "--contexts: expected an integer, got '8k'"),
    (["--contexts", "0"], "--contexts: expected an integer in [1, 1048576], got 0"),
    (["--batches", "max"], "--batches: 'max' searches the GPU's memory"),
    (["--batches", "0"], "--batches: expected positive integers or 'max'"),
    (["--methods", "oal,gla"], "--methods: expected a subset of"),
    (["--weights", "real", "--shapes", "qwen2.5-0.5b"], "--weights: real weights exist for --shapes smollm2-135m"),
    (["--prompt", "10"], "--prompt: at least 68 tokens"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        generate.parse_args(["--device", "cpu", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_profile_breaks_a_step_down_per_layer_type(tiny, monkeypatch):
    args = generate.parse_args(["--device", "cpu", "--shapes", "smollm2-135m", "--methods", "oal-swa",
                                "--contexts", "300", "--tokens", "2", "--warmup", "1", "--prompt", "80"])
    from benchmarks._decode_profile import profile_step

    text = profile_step(args, generate.convert)
    assert "oal-swa (15 converted layers), context 300" in text
    for label in ("attention (oal-swa)", "attention (softmax)", "mlp", "lm_head", "other"):
        assert label in text


def test_the_shapes_named_before_torch_are_long_context_s():
    """generate names its shapes before it imports torch (bad arguments are refused at once); they are lc's."""
    assert generate.SHAPES == tuple(lc.SHAPES)


def test_progress_goes_to_stderr_and_the_table_to_stdout(tiny, tmp_path, capsys):
    """Each row's progress line was printed on stdout, among the results (the benchmarks' rule: results on stdout,
    progress on stderr)."""
    generate.main(["--device", "cpu", "--shapes", "smollm2-135m", "--contexts", "100", "--methods", "softmax",
                   "--tokens", "1", "--warmup", "0", "--prompt", "80", "--out", str(tmp_path / "gen.json")])
    out, err = capsys.readouterr()
    assert "ctx=   100" in err and "ctx=" not in out
    assert "tokens/s" in out and "wrote" in err


def test_writes_between_rows_say_they_are_partial(tiny, tmp_path, monkeypatch):
    """A JSON left by the SIGKILL after scripts/gpu_perf.sh's SIGINT said "interrupted": false, as a finished run's;
    only the last write is `complete`."""
    import oal.rundir.files as files

    writes, real = [], files.atomic_write_json
    monkeypatch.setattr(files, "atomic_write_json", lambda path, obj: writes.append(json.loads(json.dumps(obj)))
                        or real(path, obj))
    out = tmp_path / "gen.json"
    generate.main(["--device", "cpu", "--shapes", "smollm2-135m", "--contexts", "100", "--methods", "softmax,oal",
                   "--tokens", "2", "--warmup", "1", "--prompt", "80", "--out", str(out)])
    assert [w["complete"] for w in writes] == [False, False, True]
    assert json.loads(out.read_text())["complete"] is True
