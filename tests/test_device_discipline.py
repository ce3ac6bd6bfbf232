"""Device discipline on a CPU (design.md "Contract: devices", issue 45): the stages, every method's calibration,
evaluation, generation, export and reload run with the model on a fake second device (`_fake_device`), where a
tensor left on the CPU raises as it does beside a model on CUDA.

- the fake device itself: mixing raises, one device runs (values and gradients as on the CPU), 0-dim tensors and
  CPU indices mix, `.to` / `.cpu` round trip, `module.to`, the host side (`numpy`, `item`, generators);
- one test per place that failed on the H200 (each fails on dff268e): fidelity's kernels loaded from disk into
  oal_attention, fidelity's per-sequence sums (`summarize`: err / n), the sliding windows' fidelity in bf16
  (window_attention), the budget stage's capture of CPU input_ids, and calibration of every method (DiJiang's
  projection, SpectraFormer's and Performer's random features, but also oal, global, TaylorShift and the windows,
  which failed there too), and the library entry points given CPU blocks;
- `oal run --methods all` (analyze, calibrate, fidelity, regime, budget, adapt, perplexity, zero-shot on the piqa
  fixture, report) and a bf16 run of oal, global, softmax, swa, oal-swa with `--layers auto:1` (select, compare);
- the commands on that run directory through the command line: `evaluate` (fidelity, `--zeroshot` on a fixture,
  `--passkey`), `adapt`, `generate`, `convert --export`, `export`, and the exports reloaded with `oal.load` and
  `AutoModelForCausalLM` generating through the cache; `diagnose` (Table 1, Fig. 2(b), Table 2) through its library
  function; the encoder protocol with every method; a killed adaptation resumed from its checkpoint; `oal.linearize`.
"""

import json
from pathlib import Path

import pytest
import torch
from _fake_device import FAKE, fake_device, is_fake
from test_pipeline import _plan as pipeline_plan
from test_pipeline import make_assets
from typer.testing import CliRunner

from oal.methods import build_method

FIXTURES = Path(__file__).parent / "fixtures" / "zeroshot"
LAYER = 1


# ------------------------------------------------------------------------------------------ the fake device itself


def test_mixing_devices_raises_as_cuda_does():
    with fake_device():
        a = torch.ones(3, device=FAKE)
        for op in (lambda: a + torch.ones(3), lambda: torch.cat([a, torch.ones(3)]),
                   lambda: torch.nn.Linear(3, 2)(a), lambda: torch.ones(2, 3) @ a):
            with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
                op()


def test_ops_on_one_device_run_and_stay_there():
    with fake_device():
        x = torch.randn(2, 4, device=FAKE, requires_grad=True)
        lin = torch.nn.Linear(4, 3).to(FAKE)
        y = lin(x).square().sum()
        y.backward()
        assert is_fake(y) and is_fake(x.grad) and is_fake(lin.weight.grad)
        assert isinstance(lin.weight, torch.nn.Parameter) and lin.weight.device == FAKE
        ref = torch.nn.Linear(4, 3)
        ref.load_state_dict({k: v.cpu() for k, v in lin.state_dict().items()})
        xr = x.detach().cpu().requires_grad_(True)
        ref(xr).square().sum().backward()
        torch.testing.assert_close(x.grad.cpu(), xr.grad)  # the same numbers as on the CPU
        torch.testing.assert_close(lin.weight.grad.cpu(), ref.weight.grad)
        emb = torch.nn.Embedding(10, 4).to(FAKE)
        assert emb(torch.tensor([[1, 2]], device=FAKE)).device == FAKE
        with pytest.raises(RuntimeError, match="same device"):
            emb(torch.tensor([[1, 2]]))  # CPU input_ids into a model on the device


def test_zero_dim_cpu_tensors_and_cpu_indices_mix():
    with fake_device():
        a = torch.arange(4.0, device=FAKE)
        assert is_fake(a * torch.tensor(2.0))  # CUDA lets 0-dim CPU tensors (scalars) mix
        assert a[torch.tensor([0, 2])].cpu().tolist() == [0.0, 2.0]  # and indexing with CPU indices
        a.copy_(torch.zeros(4))  # copies cross devices
        assert a.sum().item() == 0.0


def test_to_and_cpu_round_trip_and_host_side():
    with fake_device():
        t = torch.arange(6).reshape(2, 3)
        f = t.to(FAKE)
        assert is_fake(f) and f.device == FAKE and f.dtype == t.dtype
        back = f.cpu()
        assert not is_fake(back) and back.device.type == "cpu" and torch.equal(back, t)
        assert not is_fake(f.to("cpu")) and is_fake(f.to(torch.float32))
        assert f.tolist() == t.tolist() and f.sum().item() == 15 and float(f.float().mean()) == 2.5
        with pytest.raises(TypeError, match="numpy"):
            f.numpy()
        with pytest.raises(RuntimeError, match="generator"):
            torch.randn(3, generator=torch.Generator().manual_seed(0), device=FAKE)
        with torch.device(FAKE):
            assert is_fake(torch.zeros(2)) and is_fake(torch.tensor([1, 2]))


def test_module_to_moves_parameters_and_buffers():
    with fake_device():
        m = build_method("performer", 4, 2, 8)
        m.to(FAKE)
        assert all(is_fake(t) for t in [*m.parameters(), *m.buffers()])
        m.cpu()
        assert not any(is_fake(t) for t in [*m.parameters(), *m.buffers()])


# ------------------------------------------------------------------------------------------ stage by stage


def _plan():
    """test_pipeline's split plan with fewer blocks: the fake device dispatches every op in Python."""
    plan = pipeline_plan()
    for role, n in (("grouping", 4), ("adapt_train", 2), ("val", 1), ("test", 2)):
        plan[role]["indices"] = plan[role]["indices"][:n]
    return plan


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    # 512 positions hold the passkey prompt in byte tokens
    return make_assets(tmp_path_factory.mktemp("assets"), n_layers=3, max_positions=512, seed=2)


@pytest.fixture(scope="module")
def base(assets):
    """The tiny model, its tokenizer and the run's token blocks (CPU tensors: what a stage loads or builds)."""
    from oal.data import SplitPlan, plan_blocks
    from oal.data.sources import load_corpus
    from oal.models.registry import load_model

    model, tok, _ = load_model(str(assets / "model"))
    blocks = plan_blocks(load_corpus(str(assets / "corpus.txt")), tok, SplitPlan.from_dict(_plan()))
    return model.eval(), tok, blocks


def _on_device(model, dtype=torch.float32):
    import copy

    return copy.deepcopy(model).to(device=FAKE, dtype=dtype)


def _kernels(name: str, model, dtype=torch.float32) -> dict:
    """{LAYER: method} as loaded from a kernels file: built on the CPU, random groups for the grouped methods."""
    cfg = model.config
    kw = {"window": 16, "sinks": 2} if build_method(name, 6, 2, 8).settings else {}
    if build_method(name, 6, 2, 8).uses_groups:
        kw["groups"] = torch.randint(0, 3, (cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads),
                                     generator=torch.Generator().manual_seed(0))
    return {LAYER: build_method(name, cfg.num_attention_heads, cfg.num_key_value_heads,
                                cfg.hidden_size // cfg.num_attention_heads, layer_idx=LAYER, **kw)}


def test_fidelity_moves_kernels_to_the_model(base):
    """dff268e: groups (and the factor) loaded from disk reached oal_attention on the CPU beside CUDA queries (the
    fidelity stage moved its blocks, not the kernels)."""
    from oal.evaluate.fidelity import fidelity

    model, _, blocks = base
    with fake_device():
        res = fidelity(_on_device(model), blocks["fidelity"].to(FAKE),
                       {m: _kernels(m, model) for m in ("oal", "global")})
    assert all(res[m]["relmse"] >= 0 for m in ("oal", "global"))


def test_fidelity_sums_stay_on_the_device(base):
    """dff268e: `summarize` divided the per-sequence errors (on the device) by counts made on the CPU."""
    from oal.evaluate.fidelity import fidelity

    model, _, blocks = base
    with fake_device():
        methods = {"performer": {i: m.to(FAKE) for i, m in _kernels("performer", model).items()}}
        res = fidelity(_on_device(model), blocks["fidelity"].to(FAKE), methods)
    assert res["performer"]["mse"] > 0


@pytest.mark.parametrize("name", ["swa", "oal-swa"])
def test_window_fidelity_in_bfloat16(base, name):
    """dff268e: the sliding windows' kernels met bf16 CUDA queries on the CPU (window_attention)."""
    from oal.evaluate.fidelity import fidelity

    model, _, blocks = base
    with fake_device():
        res = fidelity(_on_device(model, torch.bfloat16), blocks["fidelity"].to(FAKE), {name: _kernels(name, model)})
    assert res[name]["mse"] >= 0


def test_budget_stage_captures_on_the_device(base, tmp_path):
    """dff268e: the budget stage fed the plan's CPU blocks to the model on the device (models/capture.py)."""
    from oal.analysis import analyze
    from oal.calibration.data import CalibConfig
    from oal.diagnostics.budget import run_budget

    model, tok, blocks = base
    cfg = CalibConfig(max_steps=2, val_every=1, patience=2)
    with fake_device():
        on_device = _on_device(model)
        analyze(on_device, tok, blocks["grouping"], [LAYER], tmp_path, n_bootstrap=10, figures=False)
        res = run_budget(on_device, blocks, tmp_path / "groups.json", LAYER, 0, cfg, tmp_path, budgets=(1, 2))
    assert [p["G"] for p in res["points"]] == [1, 2] and (tmp_path / "budget.json").is_file()


@pytest.fixture(scope="module")
def layer_data(base):
    """One layer's frozen calibration data on the fake device (where the calibrate stage reads it back to)."""
    from oal.calibration.model import capture_layer_data

    model, _, blocks = base
    with fake_device():
        on_device = _on_device(model)
        return tuple(capture_layer_data(on_device, blocks[r].to(FAKE), LAYER) for r in ("calib_train", "calib_val"))


METHODS = ["oal", "global", "performer", "spectraformer", "dijiang", "taylorshift", "swa", "oal-swa", "global-swa"]


@pytest.mark.parametrize("name", METHODS)
def test_calibration_of_every_method(base, layer_data, name):
    """dff268e: DiJiang's projection (and SpectraFormer's, Performer's random features) stayed on the CPU beside
    captures on the device. Each method is calibrated where its data lives and runs there."""
    from oal.calibration.data import CalibConfig
    from oal.calibration.fit import calibrate_methods

    model, _, _ = base
    train, val = layer_data
    assert is_fake(train.q)
    groups = _kernels("oal", model)[LAYER].groups
    with fake_device():
        done = calibrate_methods([name], train, val, layer=LAYER, groups=groups, options={"window": 16, "sinks": 2},
                                 cfg=CalibConfig(max_steps=2, val_every=1, patience=2))
        method, res = done[name]
        out = method(val.q, val.k, val.v)
    assert is_fake(out) and bool(torch.isfinite(out.cpu()).all())
    assert res is None or all(h.val_mse >= 0 for h in res.heads)


def test_library_entry_points_take_cpu_inputs(base):
    """What a stage loads or builds (blocks, kernels) may come on the CPU: the library functions that run the model
    move it to the model's device once, on entry (dff268e: CPU input_ids reached the model's embedding)."""
    from oal.calibration.model import capture_layer_data
    from oal.evaluate.fidelity import fidelity
    from oal.evaluate.perplexity import block_nll

    model, _, blocks = base
    with fake_device():
        on_device = _on_device(model)
        assert is_fake(capture_layer_data(on_device, blocks["calib_val"], LAYER).q)
        assert fidelity(on_device, blocks["fidelity"], {"oal": _kernels("oal", model)})["oal"]["mse"] > 0
        total, count = block_nll(on_device, blocks["test"])
    assert total > 0 and count == blocks["test"].numel() - blocks["test"].shape[0]


# ------------------------------------------------------------------------------------------ oal run and the commands


def _run_config(assets, methods, **kw):
    from oal.pipeline.config import RunConfig

    kw = {"zeroshot_tasks": ["piqa"], "zeroshot_files": {"piqa": str(FIXTURES / "piqa.jsonl")}, "zeroshot_limit": 2,
          **kw}
    return RunConfig(model=str(assets / "model"), data=str(assets / "corpus.txt"), plan=_plan(), methods=methods,
                     device=str(FAKE), grouping={"n_bootstrap": 10}, calib={"max_steps": 2, "val_every": 1,
                                                                          "patience": 2},
                     adapt={"steps": 1, "val_every": 1, "ckpt_every": 1}, window=16, sinks=2, **kw)


@pytest.fixture(scope="module")
def full_run(assets, tmp_path_factory):
    """`oal run --methods all` on the fake device: analyze, calibrate (every method), fidelity, regime, budget,
    adapt, perplexity, zero-shot (the piqa fixture) and the report."""
    from oal.pipeline.runs import run

    out = tmp_path_factory.mktemp("run")
    with fake_device():
        metrics = run(_run_config(assets, ["all"], layers=[LAYER]), out, progress=False)
    return out, metrics


@pytest.mark.slow
def test_run_every_method(full_run):
    from oal.methods import method_names

    out, metrics = full_run
    assert set(metrics["perplexity"]) == set(method_names())
    assert set(metrics["fidelity"]) == set(method_names()) - {"softmax"}
    assert set(metrics["zeroshot"]["oal"]) == {"piqa"} and (out / "budget.json").is_file()
    assert all(v > 0 for v in metrics["elapsed_s"].values())


@pytest.mark.slow
def test_run_windows_in_bfloat16_with_layer_selection(assets, tmp_path):
    from oal.pipeline.runs import run

    with fake_device():
        metrics = run(_run_config(assets, ["oal", "global", "softmax", "swa", "oal-swa"], dtype="bfloat16",
                                  select={"k": 1, "by": "fidelity"}, zeroshot_limit=None, zeroshot_tasks=[]),
                      tmp_path, progress=False)
    assert len(metrics["converted_layers"]) == 1 and set(metrics["selection"]["comparison"])
    assert set(metrics["perplexity"]) == {"oal", "global", "softmax", "swa", "oal-swa"}


def _cli(*args):
    """`oal --debug ARGS` in this process (a failure keeps its traceback)."""
    from oal.cli import load_commands

    res = CliRunner().invoke(load_commands(), ["--debug", *map(str, args)])
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    assert res.exit_code == 0, res.output
    return res.output


@pytest.fixture()
def run_copy(full_run, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(full_run[0], out)
    return out


def test_evaluate_commands(run_copy):
    with fake_device():
        _cli("evaluate", "--out", run_copy, "--methods", "oal,performer", "--device", FAKE)
        _cli("evaluate", "--out", run_copy, "--methods", "oal", "--zeroshot", "--task-file",
             f"arc_easy={FIXTURES / 'arc_easy.jsonl'}", "--limit", 2, "--device", FAKE)
        _cli("evaluate", "--out", run_copy, "--methods", "oal,softmax", "--passkey", "--lengths", 300, "--depths",
             0.5, "--trials", 1, "--device", FAKE)
    metrics = json.loads((run_copy / "metrics.json").read_text())
    assert set(metrics["passkey"]) == {"oal", "softmax"} and "arc_easy" in metrics["zeroshot"]["oal"]


def test_adapt_generate_convert_export_and_reload(run_copy, assets, tmp_path):
    from transformers import AutoModelForCausalLM

    import oal

    with fake_device():
        _cli("adapt", "--out", run_copy, "--method", "dijiang", "--steps", 2, "--device", FAKE)
        assert "kernel" in _cli("generate", "--out", run_copy, "--method", "oal", "--max-new-tokens", 3,
                                "--device", FAKE, "kernel query")
        _cli("convert", "--out", run_copy, "--method", "oal-swa", "--export", tmp_path / "swa", "--device", FAKE)
        _cli("export", "--out", run_copy, "--method", "performer", "--to", tmp_path / "exported")
        for model in (oal.load(tmp_path / "exported", device=FAKE),
                      AutoModelForCausalLM.from_pretrained(tmp_path / "exported").to(FAKE)):
            ids = torch.tensor([[5, 17, 99, 3]], device=FAKE)
            seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                                 do_sample=False, use_cache=True, pad_token_id=0)
            assert is_fake(seq) and seq.shape == (1, 7)


def test_diagnose(base, tmp_path):
    from oal.calibration.data import CalibConfig
    from oal.diagnostics.retained_error import RetainedErrorConfig
    from oal.diagnostics.runner import diagnose

    model, _, blocks = base
    with fake_device():
        res = diagnose(_on_device(model), blocks, [LAYER], tmp_path, parts=("table1", "budget", "table2"),
                       table2_methods=("performer", "oal", "swa"), grouping={"n_bootstrap": 10},
                       table1_cfg=RetainedErrorConfig.preset("default", n_controls=2), budgets=(1, 2),
                       calib_cfg=CalibConfig(max_steps=2, val_every=1, patience=2))
    assert set(res) == {"table1", "budget", "table2"}


def test_encoder_run(tmp_path):
    """The encoder protocol (a tiny BERT): analysis, calibration of every method, fidelity, pooled embeddings."""
    import random

    from _tiny_encoders import save_tiny_encoder
    from test_encoder_pipeline import WORDS
    from test_encoder_pipeline import _cfg as encoder_config

    from oal.pipeline.runs import run

    save_tiny_encoder(tmp_path / "model", WORDS)
    rng = random.Random(0)
    (tmp_path / "corpus.txt").write_text("\n\n".join(
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 50))) + "." for _ in range(900)))
    cfg = encoder_config(tmp_path, methods=["all"], device=str(FAKE))
    cfg.calib = {"max_steps": 2, "val_every": 1, "patience": 2}
    with fake_device():
        metrics = run(cfg, tmp_path / "run", progress=False)
    assert set(metrics["fidelity"]) >= {"oal", "performer", "dijiang"} and metrics["embedding"]


def test_adaptation_resumes_on_the_device(tmp_path):
    """A killed adaptation resumes from its checkpoint (optimizer state, best tensors, RNG) on the device, to the
    same result as an uninterrupted one."""
    from test_adapt import _Kill, _run

    def run(ckpt, kill_after=None):
        return _run(ckpt, kill_after, steps=4, device=FAKE)

    with fake_device():
        _, ref = run(tmp_path / "ref")
        with pytest.raises(_Kill):
            run(tmp_path / "killed", kill_after=3)
        model, res = run(tmp_path / "killed")
    assert res.history == ref.history and res.best_val_nll == ref.best_val_nll
    assert all(is_fake(p) for p in model.parameters())


def test_linearize(base):
    """`oal.linearize` on a model on the device: analysis, calibration and the swap, then generation."""
    import oal

    model, tok, _ = base
    texts = [" ".join(["alpha beta gamma delta kernel query key value head group"] * 40)] * 4
    with fake_device():
        converted = oal.linearize(_on_device(model), tok, texts, layers=[LAYER], block_len=64, calib_blocks=2,
                                  calib={"max_steps": 2, "val_every": 1, "patience": 2}, progress=False)
        ids = torch.tensor([[5, 17, 99]], device=FAKE)
        seq = converted.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                                 do_sample=False, pad_token_id=0)
    assert is_fake(seq) and seq.shape == (1, 6)
