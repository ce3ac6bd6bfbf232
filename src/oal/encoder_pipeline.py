"""`oal run` for BERT-family encoders, resumable like the decoder protocol (`oal.pipeline`, whose stage
mechanism it reuses):

    setup -> analyze -> calibrate -> fidelity -> embedding -> report

- data: paragraphs of the corpus, each tokenised with the model's special tokens and right-padded
  (`oal.data.passages`); roles grouping / calib_train / calib_val / heldout, disjoint;
- analyze: contribution scores over every pair of real tokens (Eq. 2, non-causal) and App. B grouping; the
  prefix-length check (Table 4) is causal-only and is left out;
- calibrate: output matching of the non-causal normalised output (Eq. 20, all real keys visible), the same
  driver and protocol as for decoders;
- fidelity: Eq. 21-22 on the held-out passages, padded positions left out;
- embedding: cosine similarity of pooled embeddings (mean and [CLS]) of each converted model against the
  original on the held-out passages, through the ordinary HF forward;
- adaptation (LoRA) and perplexity are decoder-only and do not run; the report says so.

The converted model is rebuilt from the files on disk for every evaluation (kernels on the base model), as in
the decoder protocol.
"""

from __future__ import annotations

from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from .analysis import analyze
from .calibrate import LayerData
from .config import RunConfig
from .data import load_corpus
from .data.passages import PassagePlan, default_passage_plan, plan_passages, tokenize_passages
from .evaluate.embedding import cosine_summary, sentence_embeddings
from .evaluate.fidelity import fidelity
from .models.capture import capture
from .models.encoder import load_encoder
from .pipeline import NEEDS_GROUPS, Run, _jsonable_provenance, _mean_std, _Stop
from .runio import Timer, atomic_write_json, config_hash, load_json, tensor_hash, versions

__all__ = ["EncoderRun", "run_encoder", "run_encoder_seed"]

CAPTURE_BATCH = 8
FIDELITY_FILE = ".oal/fidelity.json"  # the decoder protocol's place for it too
EMBEDDING_FILE = ".oal/embedding.json"


class EncoderRun(Run):
    """One seed's run directory for an encoder; `blocks[role]` holds tokenised passages (input_ids, mask)."""

    def _load_model(self):
        return load_encoder(self.cfg.model, dtype=getattr(torch, self.cfg.dtype), device=self.cfg.device)

    def setup(self) -> None:
        """Encoder, tokenizer, corpus, passage plan and tokenised passages; writes config.json (always runs)."""
        with Timer() as t:
            self.model, self.tokenizer, self.provenance = self._load_model()
            self.model.requires_grad_(False)
            self.corpus = load_corpus(self.cfg.data, data_dir=self.cfg.data_dir)
            self.plan = PassagePlan.from_dict(self.cfg.plan) if self.cfg.plan else default_passage_plan()
            texts = plan_passages(self.corpus, self.plan)
            self.blocks = {role: tokenize_passages(self.tokenizer, t, self.plan.max_len) for role, t in texts.items()}
            self.layers = self.cfg.layers if self.cfg.layers is not None else self._default_layers()
            n_layers = self.model.config.num_hidden_layers
            if any(i >= n_layers for i in self.layers):
                raise ValueError(f"layers: {self.layers} out of range for an encoder with {n_layers} layers")
        passages = {role: {"shape": list(b["input_ids"].shape), "real_tokens": int(b["attention_mask"].sum()),
                           "sha256_16": tensor_hash(torch.stack([b["input_ids"], b["attention_mask"]]))}
                    for role, b in self.blocks.items()}
        config = {"protocol": "encoder", "config": self.cfg.to_dict(), "converted_layers": self.layers,
                  "passage_plan": self.plan.to_dict(), "passages": passages,
                  "model": _jsonable_provenance(self.provenance),
                  "data": {"name": self.corpus.name, "sha256": self.corpus.sha256,
                           "meta": _jsonable_provenance(self.corpus.meta)},
                  "versions": versions()}
        self.keys["setup"] = config_hash({k: config[k] for k in ("protocol", "converted_layers", "passage_plan",
                                                                "passages", "model", "data")}
                                         | {"dtype": self.cfg.dtype})
        atomic_write_json(self.dir / "config.json", config)
        self.log.mark("setup", self.keys["setup"], t.seconds)

    def analyze(self) -> bool:
        if not any(m in NEEDS_GROUPS for m in self.cfg.methods):
            return True
        deps = {"setup": self.keys["setup"], "grouping": self.cfg.grouping, "seed": self.cfg.seed}

        def fn():  # held-out passages give the App. A.3 input-stability check; Table 4 is causal-only
            analyze(self.model, self.tokenizer, self.blocks["grouping"], self.layers, self.dir,
                    heldout=self.blocks["heldout"], seed=self.cfg.seed, console=self.console, **self.cfg.grouping)

        return self.stage("analyze", deps, ["groups.json"], fn)

    def _capture(self, role: str, layer: int) -> LayerData:
        """Frozen non-causal q/k/v/out of `layer` on the passages of `role`, with their padding mask."""
        ids, mask = self.blocks[role]["input_ids"], self.blocks[role]["attention_mask"]
        got = []
        with torch.no_grad():
            for s in range(0, ids.shape[0], CAPTURE_BATCH):
                capture(self.model, ids[s : s + CAPTURE_BATCH], [layer], got.append, mask[s : s + CAPTURE_BATCH],
                        stop_after_last=True)
        return LayerData.from_captured(got)

    def _evaluation(self, name: str, path: str, compute) -> bool:
        """A held-out evaluation stage over every kernel method: `compute(methods)` -> JSON at `path`."""
        methods = self.kernel_methods
        if not methods:
            return True
        deps = {"calibrate": self.keys.get("calibrate"), "methods": methods}
        return self.stage(name, deps, [path], lambda: atomic_write_json(self.dir / path, compute(methods)))

    def fidelity(self) -> bool:
        """Eq. 21-22 on the held-out passages, padded positions left out."""
        held = self.blocks["heldout"]
        return self._evaluation("fidelity", FIDELITY_FILE, lambda methods: fidelity(
            self.model, held["input_ids"], {m: self.load_methods(m) for m in methods}, self.layers,
            batch_size=CAPTURE_BATCH, attention_mask=held["attention_mask"], progress=self.progress))

    def embedding(self) -> bool:
        """Cosine similarity of pooled embeddings, each converted model against the original (held-out passages)."""
        return self._evaluation("embedding", EMBEDDING_FILE, self._embedding)

    def _embedding(self, methods: list[str]) -> dict:
        held = self.blocks["heldout"]
        ref = sentence_embeddings(self.model, held, batch_size=CAPTURE_BATCH)
        out = {}
        for m in methods:
            got = sentence_embeddings(self.model_for(m), held, batch_size=CAPTURE_BATCH)
            out[m] = {p: cosine_summary(ref[p], got[p]) for p in ref}
        return out

    def metrics(self) -> dict:
        out = {"model": str(self.cfg.model), "protocol": "encoder", "converted_layers": self.layers,
               "seed": self.cfg.seed, "methods": self.cfg.methods, "pooling": self.provenance.get("pooling"),
               "fidelity": {}, "embedding": {}, "perplexity": {}, "perplexity_no_adapt": {}, "adapt": {},
               "not_run": {"adapt": "adaptation (LoRA + kernels) is implemented for causal LMs only",
                           "perplexity": "encoders have no next-token objective"}}
        for key, path in (("fidelity", FIDELITY_FILE), ("embedding", EMBEDDING_FILE)):
            if (self.dir / path).exists() and key in self.keys:
                out[key] = load_json(self.dir / path)
        out["elapsed_s"] = {k: v for k, v in self.log.elapsed().items() if k != "report"}
        return out


def run_encoder_seed(cfg: RunConfig, out_dir: str | Path, *, console: Console | None = None, progress: bool = True,
                     stop_after: str | None = None) -> dict:
    """All encoder stages for one seed; returns metrics.json's content ({} when stopped by `stop_after`)."""
    from .encoder_report import write_encoder_report

    r = EncoderRun(cfg, out_dir, console=console, progress=progress, stop_after=stop_after)
    try:
        r.setup()
        r.analyze()
        r.calibrate()
        r.fidelity()
        r.embedding()
    except _Stop:
        return {}
    metrics = r.metrics()
    atomic_write_json(r.dir / "metrics.json", metrics)
    with Timer() as t:
        write_encoder_report(r.dir, console=r.console)
    r.log.mark("report", config_hash(metrics), t.seconds)
    metrics["elapsed_s"]["report"] = round(t.seconds, 3)
    atomic_write_json(r.dir / "metrics.json", metrics)
    return metrics


def _aggregate(per_seed: dict[int, dict]) -> dict:
    """Mean and sample std over seeds of every fidelity and cosine number; per-seed metrics kept."""
    from .pipeline import aggregate_seeds

    out = aggregate_seeds(per_seed)
    seeds = sorted(per_seed)
    first = per_seed[seeds[0]]
    out.update(protocol="encoder", pooling=first.get("pooling"), not_run=first.get("not_run"), embedding={},
               embedding_std={})
    for m, pools in first.get("embedding", {}).items():
        out["embedding"][m], out["embedding_std"][m] = {}, {}
        for p in pools:
            mean, std = _mean_std([per_seed[s]["embedding"][m][p]["mean"] for s in seeds])
            out["embedding"][m][p] = {"mean": mean, "min": min(per_seed[s]["embedding"][m][p]["min"] for s in seeds)}
            out["embedding_std"][m][p] = {"mean": std}
    return out


def run_encoder(cfg: RunConfig, out_dir: str | Path, seeds: list[int] | None = None, *,
                console: Console | None = None, progress: bool = True) -> dict:
    """`oal run` on an encoder: one seed writes DIR directly; several write DIR/seed-<s>/ and aggregate into DIR."""
    from .encoder_report import write_encoder_report

    console = console or Console()
    out_dir = Path(out_dir)
    seeds = seeds or [cfg.seed]
    if len(seeds) == 1:
        metrics = run_encoder_seed(cfg.with_seed(seeds[0]), out_dir, console=console, progress=progress)
    else:
        per_seed = {}
        for s in seeds:
            console.rule(f"[bold]seed {s}")
            per_seed[s] = run_encoder_seed(cfg.with_seed(s), out_dir / f"seed-{s}", console=console,
                                           progress=progress)
        metrics = _aggregate(per_seed)
        atomic_write_json(out_dir / "config.json", load_json(out_dir / f"seed-{seeds[0]}" / "config.json"))
        atomic_write_json(out_dir / "metrics.json", metrics)
        write_encoder_report(out_dir, console=console)
    console.print(summary_table(metrics))
    return metrics


def summary_table(metrics: dict) -> Table:
    """methods x (fidelity, embedding cosine) for the terminal."""
    table = Table(title=f"oal run (encoder): {metrics.get('model')} (layers {metrics.get('converted_layers')})")
    for col in ("method", "RelMSE", "RelMSE post-o", "cos (mean pool)", "cos ([CLS])", "min cos (mean pool)"):
        table.add_column(col, justify="right")
    for m in metrics.get("methods", []):
        f, e = metrics.get("fidelity", {}).get(m, {}), metrics.get("embedding", {}).get(m, {})
        table.add_row(m, *(f"{f[k]:.4f}" if k in f else "-" for k in ("relmse", "relmse_post_o")),
                      *(f"{e[p]['mean']:.5f}" if p in e else "-" for p in ("mean", "cls")),
                      f"{e['mean']['min']:.5f}" if "mean" in e else "-")
    return table
