"""`oal run` for BERT-family encoders: `EncoderRun`, the decoder protocol's `pipeline.decoder.Run` with encoder hooks
(setup, the stage mechanism, provenance checks, one-pass capture and per-layer calibration checkpoints are Run's):

    setup -> analyze -> calibrate -> fidelity -> embedding -> report

- data: paragraphs of the corpus, each tokenised with the model's special tokens and right-padded
  (`oal.data.passages`); roles grouping / calib_train / calib_val / heldout, disjoint;
- analyze: contribution scores over every pair of real tokens (Eq. 2, non-causal) and App. B grouping; the
  prefix-length check (Table 4) is causal-only and is left out;
- calibrate: output matching of the non-causal normalised output (Eq. 20, all real keys visible), the same
  driver, one-pass capture store (q/k/v/out with the padding mask) and per-layer checkpoints as for decoders;
- fidelity: Eq. 21-22 on the held-out passages, padded positions left out;
- embedding: cosine similarity of pooled embeddings (mean and [CLS], and the folder's own sentence-transformers
  pooling when it declares another) of each converted model against the original on the held-out passages,
  through the ordinary HF forward;
- adaptation (LoRA), perplexity and zero-shot are decoder-only and do not run; the report says so.

The converted model is rebuilt from the files on disk for every evaluation (kernels on the base model), as in
the decoder protocol.
"""

from __future__ import annotations

import torch
from rich.table import Table

from oal.data.passages import PassagePlan, default_passage_plan, plan_passages, tokenize_passages
from oal.device import resolve_dtype
from oal.errors import InputError
from oal.evaluate.embedding import POOLINGS, cosine_summary, sentence_embeddings
from oal.models.encoder import load_encoder, max_tokens
from oal.pipeline.aggregate import _mean_std, aggregate_seeds
from oal.pipeline.base import FIDELITY_FILE
from oal.pipeline.decoder import Run
from oal.rundir.files import load_json
from oal.rundir.hashes import tensor_hash

__all__ = ["EMBEDDING_FILE", "EncoderRun", "summary_table"]

BATCH = 8  # passages per forward in the held-out evaluations
EMBEDDING_FILE = ".oal/embedding.json"
NOT_RUN = {"adapt": "adaptation (LoRA + kernels) is implemented for causal LMs only",
           "perplexity": "encoders have no next-token objective",
           "zeroshot": "the zero-shot tasks score a causal LM's continuations"}


class EncoderRun(Run):
    """One seed's run directory for an encoder; `blocks[role]` holds tokenised passages (input_ids, attention_mask)."""

    protocol = "encoder"
    # settings no encoder stage reads (adaptation, the decoders' evaluations): another value of one resumes the run
    # instead of refusing the directory as another configuration
    UNREAD = ("config.adapt", "config.eval_batch_size", "config.zeroshot_dir")

    def __init__(self, cfg, out_dir, *, allow_changes: tuple[str, ...] = (), **kwargs):
        super().__init__(cfg, out_dir, allow_changes=(*allow_changes, *self.UNREAD), **kwargs)

    def setup(self, check=None) -> None:
        if (self.cfg.grouping or {}).get("pairs"):  # refused before anything is written
            raise InputError("app-b-pairs ties RoPE's rotation pairs (r, r + d/2); an encoder has no RoPE: use "
                             "app-b or budget:G", "--grouping", "grouping")
        super().setup(check)

    def _load_model(self):  # self.device: Run's, this process's device under a launch
        return load_encoder(self.cfg.model, dtype=resolve_dtype(self.cfg.dtype), device=self.device)

    def _plan_blocks(self) -> tuple:
        plan = PassagePlan.from_dict(self.cfg.plan) if self.cfg.plan else default_passage_plan()
        texts = plan_passages(self.corpus, plan)
        # no longer than the position embeddings: a tokenizer may set no model_max_length (transformers' 1e30)
        max_len = min(plan.max_len, max_tokens(self.model) or plan.max_len)
        return plan, {role: tokenize_passages(self.tokenizer, t, max_len) for role, t in texts.items()}

    def _blocks_record(self) -> dict:
        return {role: {"shape": list(b["input_ids"].shape), "real_tokens": int(b["attention_mask"].sum()),
                       "sha256_16": tensor_hash(torch.stack([b["input_ids"], b["attention_mask"]]))}
                for role, b in self.blocks.items()}

    def _analysis_inputs(self) -> dict:
        # held-out passages give the App. A.3 input-stability check; the prefix-length check (Table 4) is causal-only
        return {"heldout": self.blocks["heldout"]}

    def _fidelity_data(self) -> tuple:
        held = self.blocks["heldout"]
        return held["input_ids"].to(self.device), {"batch_size": BATCH,
                                                   "attention_mask": held["attention_mask"].to(self.device)}

    def embedding(self) -> bool:
        """Cosine similarity of pooled embeddings, each converted model against the original (held-out passages)."""
        poolings = self._poolings()
        # a declared pooling besides the two usual ones joins the key (the usual runs keep theirs)
        extra = {"poolings": list(poolings)} if poolings != POOLINGS else None
        return self.evaluation("embedding", EMBEDDING_FILE, lambda methods: self._embedding(methods, poolings), extra)

    def _poolings(self) -> tuple[str, ...]:
        """Mean and [CLS] pooling, and the folder's own when it declares another (its `1_Pooling`)."""
        own = self._pooling()
        return POOLINGS + ((own,) if own and own not in POOLINGS else ())

    def _embedding(self, methods: list[str], poolings: tuple[str, ...] = POOLINGS) -> dict:
        held = self.blocks["heldout"]
        ref = sentence_embeddings(self.model, held, batch_size=BATCH, poolings=poolings)
        out = {}
        for m in methods:
            got = sentence_embeddings(self.model_for(m), held, batch_size=BATCH, poolings=poolings)
            out[m] = {p: cosine_summary(ref[p], got[p]) for p in ref}
        return out

    def stages(self, arms: list[str] | None = None) -> None:
        self.analyze()
        self.calibrate()
        self.fidelity()
        self.embedding()

    def results(self, valid) -> dict:
        out = {"model": str(self.cfg.model), "protocol": self.protocol, "converted_layers": self.layers,
               "seed": self.cfg.seed, "methods": self.cfg.methods, "pooling": self._pooling(),
               "fidelity": {}, "embedding": {}, "perplexity": {}, "perplexity_no_adapt": {}, "adapt": {},
               "not_run": dict(NOT_RUN)}
        for key, path in (("fidelity", FIDELITY_FILE), ("embedding", EMBEDDING_FILE)):
            if valid(key):
                out[key] = load_json(self.dir / path)
        return out

    def _pooling(self) -> str | None:
        """The sentence pooling the encoder's folder declares; from config.json when the run was rebuilt from its
        records (`pipeline.publish`: `oal export`, `oal evaluate`), which loads no model."""
        provenance = getattr(self, "provenance", None)
        if provenance is None:
            provenance = load_json(self.dir / "config.json").get("model") or {}
        return provenance.get("pooling")

    @staticmethod
    def report(run_dir, console) -> None:
        from oal.pipeline.encoder_report import write_encoder_report

        write_encoder_report(run_dir, console=console)

    @staticmethod
    def aggregate(per_seed: dict[int, dict]) -> dict:
        """Mean and sample std over seeds of every fidelity and cosine number; per-seed metrics kept."""
        out = aggregate_seeds(per_seed)
        seeds = sorted(per_seed)
        first = per_seed[seeds[0]]
        out.update(protocol="encoder", pooling=first.get("pooling"), not_run=first.get("not_run"), embedding={},
                   embedding_std={})
        for m, pools in first.get("embedding", {}).items():
            out["embedding"][m], out["embedding_std"][m] = {}, {}
            for p in pools:
                mean, std = _mean_std([per_seed[s]["embedding"][m][p]["mean"] for s in seeds])
                out["embedding"][m][p] = {"mean": mean,
                                          "min": min(per_seed[s]["embedding"][m][p]["min"] for s in seeds)}
                out["embedding_std"][m][p] = {"mean": std}
        return out

    @staticmethod
    def summary(metrics: dict) -> Table:
        return summary_table(metrics)


def summary_table(metrics: dict) -> Table:
    """methods x (fidelity, embedding distance 1 - cos) for the terminal: near 1, cosines need up to 10 decimals,
    which four pooled columns cannot show in 80 characters; report.md gives the cosines."""
    table = Table(title=f"oal run (encoder): {metrics.get('model')} (layers {metrics.get('converted_layers')})")
    own = metrics.get("pooling")
    poolings = POOLINGS + ((own,) if own and own not in POOLINGS else ())  # the folder's own pooling too
    labels = {"mean": "1-cos (mean pool)", "cls": "1-cos ([CLS])"}
    for col in ("method", "RelMSE", "RelMSE post-o", *(labels.get(p, f"1-cos ({p}, own)") for p in poolings),
                "max 1-cos (mean pool)"):
        table.add_column(col, justify="right")
    for m in metrics.get("methods", []):
        f, e = metrics.get("fidelity", {}).get(m, {}), metrics.get("embedding", {}).get(m, {})
        table.add_row(m, *(f"{f[k]:.4f}" if k in f else "-" for k in ("relmse", "relmse_post_o")),
                      *(_distance(e[p]["mean"]) if p in e else "-" for p in poolings),
                      _distance(e["mean"]["min"]) if "mean" in e else "-")
    return table


def _distance(cos: float) -> str:
    return f"{1.0 - cos:.2e}"
