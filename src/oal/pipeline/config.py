"""`RunConfig`: everything `oal run` needs, with the paper's protocols as presets.

The block split (which token blocks serve grouping, calibration, adaptation, validation and test) is not part of
this dataclass: it comes from `oal.data.default_plan(preset)` and is recorded in config.json next to it.
"""

from __future__ import annotations

import copy
import numbers
from dataclasses import asdict, dataclass, field
from pathlib import Path

from oal.adaptation.config import AdaptConfig
from oal.data.zeroshot import parse_task_files, parse_tasks
from oal.device import resolve_dtype
from oal.errors import InputError, from_known_keys, parse_names

__all__ = ["ALL_METHODS", "DEFAULT_METHODS", "PRESETS", "SINKS", "WINDOW", "RunConfig", "check_task_files",
           "grouping_preset", "parse_methods", "parse_seeds"]

DEFAULT_METHODS = ("oal", "global", "softmax")
ALL_METHODS = ("oal", "global", "softmax", "performer", "spectraformer", "dijiang", "taylorshift", "swa", "oal-swa",
               "global-swa")
WINDOW, SINKS = 64, 4  # the sliding windows' defaults (`--window`, `--sinks`)

# Per preset: model, corpus, calibration (App. B) and adaptation (App. F.2) budgets. Grouping parameters
# (alpha, gamma, tau, Gmin, B) come from `oal.models.registry.PRESETS` (the backbone's own, App. B).
# "default" is sized so that the whole `oal run` on the embedded model fits in ~10 minutes on a 2-core CPU.
PRESETS: dict[str, dict] = {
    "default": {
        "model": "default",
        "data": "builtin",
        "calib": {"max_steps": 400, "val_every": 50, "patience": 150},
        "adapt": {"steps": 256, "val_every": 64, "ckpt_every": 32},
        # where the hub is reachable: the first 100 examples per zero-shot task keep the budget (reported as a
        # quick run); the embedded byte-level model is near chance on the full sets anyway
        "zeroshot_limit": 100,
    },
    "qwen2.5-0.5b": {
        "model": "Qwen/Qwen2.5-0.5B",
        "data": "wikitext-103-raw-v1",
        "calib": {"max_steps": 1000, "val_every": 100, "patience": 400},
        "adapt": {"steps": 512, "val_every": 128, "ckpt_every": 32},
    },
    "llama-3.2-1b": {
        "model": "meta-llama/Llama-3.2-1B",
        "data": "wikitext-103-raw-v1",
        "calib": {"max_steps": 1000, "val_every": 100, "patience": 400},
        "adapt": {"steps": 512, "val_every": 128, "ckpt_every": 32},
    },
    # SmolLM2-135M from its GGUF (`oal fetch smollm2-135m`): the paper's protocol scaled to a 2-core CPU. The corpus
    # is the builtin one (WikiText is not reachable offline) with the default plan's block sizes; the budgets keep the
    # whole `oal run --preset smollm2-135m` under 30 minutes on 2 cores (docs/results/smollm2.md).
    "smollm2-135m": {
        "model": "smollm2-135m",
        "data": "builtin",
        # validation MSE is flat after ~150 steps on this model (layers 13-14, 18 heads: the best by step 150 is within
        # 1.6% of the 400-step best, 0.2% on average)
        "calib": {"max_steps": 150, "val_every": 25, "patience": 75},
        # 32 updates of 256 tokens per arm (with two validations): 175 s (softmax) to 507 s (oal, 24 converted layers)
        # on one thread at load ~4; 128 would not fit three arms in the budget
        "adapt": {"steps": 32, "val_every": 16, "ckpt_every": 8},
        "zeroshot_limit": 100,
    },
}


def grouping_preset(preset: str) -> dict:
    """`stable_gap_groups` keyword arguments of a preset, from the model registry (App. B per backbone)."""
    from oal.models.registry import PRESETS as MODEL_PRESETS

    if preset not in MODEL_PRESETS:
        raise ValueError(f"preset: expected one of {sorted(MODEL_PRESETS)}, got {preset!r}")
    p = MODEL_PRESETS[preset]
    return {"tail_fraction": p["alpha"], "min_support": p["gamma"], "min_ratio": p["tau"],
            "min_groups": p["min_groups"], "n_bootstrap": p["n_bootstrap"]}


def parse_methods(spec: str | list[str] | tuple[str, ...]) -> list[str]:
    """'oal,global' -> ['oal', 'global']; 'all' -> every method (softmax, the reference arm, included)."""
    out = parse_names(spec, ALL_METHODS, "methods")
    if not out:
        raise InputError("expected a comma-separated list of method names or 'all', got nothing", "--methods",
                         "methods")
    return out


def check_task_files(tasks, files: dict) -> None:
    """A --task-file of a task outside --tasks would be read by nothing (yet recorded): refused, naming it."""
    selected = parse_tasks(tasks)
    unread = sorted(set(files or {}) - set(selected))
    if unread:
        raise InputError(f"{', '.join(unread)} is not among the tasks evaluated ({', '.join(selected) or 'none'}): "
                         "add it to --tasks, or leave its file out", "--task-file", "zeroshot_files")


MAX_SEED = 2**32


def parse_seeds(spec: str | int | list[int]) -> list[int]:
    """'42,43,44' -> [42, 43, 44]: distinct non-negative integers, no empty items. A bool is not a seed (True ran
    as seed 1)."""
    items = spec.split(",") if isinstance(spec, str) else list(spec) if isinstance(spec, (list, tuple, range)) \
        else [spec]
    if any(isinstance(s, bool) or not isinstance(s, (str, numbers.Integral)) for s in items):
        raise ValueError(f"seeds: expected integers or a string such as '42,43,44', got {spec!r}")
    try:
        seeds = [int(s) if isinstance(s, int) else int(str(s).strip()) for s in items]
    except ValueError as exc:
        raise ValueError(f"seeds: expected comma-separated integers such as 42,43,44, got {spec!r}") from exc
    if not seeds or len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
        raise ValueError(f"seeds: expected distinct non-negative integers, got {spec!r}")
    if max(seeds) >= MAX_SEED:  # torch and Python generators take it; every seed derived from it stays in range
        raise ValueError(f"seeds: expected integers below 2**32 = {MAX_SEED}, got {max(seeds)}")
    return seeds


def parse_select(spec) -> dict:
    """{"k": K, "by": criterion} of layer selection, from such a dict or from 'auto:K' (the default criterion)."""
    from oal.pipeline.selection import CRITERIA, DEFAULT_CRITERION, parse_auto

    d = {"k": parse_auto(spec), "by": DEFAULT_CRITERION} if isinstance(spec, str) else dict(spec)
    k, by = d.get("k"), d.get("by", DEFAULT_CRITERION)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1 or set(d) - {"k", "by"}:
        raise ValueError(f"select: expected 'auto:K' or {{'k': K >= 1, 'by': ...}}, got {spec!r}")
    if by not in CRITERIA:
        raise ValueError(f"select: expected a criterion among {', '.join(CRITERIA)}, got {by!r}")
    return {"k": k, "by": by}


@dataclass
class RunConfig:
    """The configuration of `oal run` (what config.json records): the model, corpus and preset, the methods, the
    converted layers (or `select` for `auto:K`), the seed, the calibration, adaptation and evaluation settings.
    `RunConfig.from_preset(name, **overrides)` fills it from a preset, as the command line does."""

    model: str = "default"
    data: str = "builtin"
    preset: str = "default"
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    layers: list[int] | None = None  # None: the model family's default conversion range
    seed: int = 42
    dtype: str = "float32"
    device: str = "auto"  # resolved when the run starts (oal.device.resolve_device): a runtime choice, not hashed
    grouping: dict = field(default_factory=dict)
    calib: dict = field(default_factory=dict)
    adapt: dict = field(default_factory=dict)
    eval_batch_size: int = 1
    plan: dict | None = None  # a SplitPlan.to_dict() replacing the preset's split plan (encoders: a PassagePlan's)
    data_dir: str | None = None  # local WikiText folder (with manifest) for the paper presets
    adapt_overrides: dict = field(default_factory=dict)  # method -> adapt settings of that arm only (`oal adapt`)
    zeroshot_tasks: list[str] | None = None  # PIQA / HellaSwag / ARC-E (App. F.3); None: all three, []: none
    zeroshot_limit: int | None = None  # first N examples of each task (a quick run, reported as such)
    zeroshot_dir: str | None = None  # local folder of the pinned zero-shot files (with manifest)
    zeroshot_files: dict = field(default_factory=dict)  # task -> local JSON-lines file (unverified, hash recorded)
    select: dict | None = None  # `--layers auto:K`: {"k": K, "by": "fidelity" | "probe"} (oal.pipeline.selection)
    window: int = WINDOW  # swa, oal-swa, global-swa: the last `window` keys get exact softmax weights
    sinks: int = SINKS  # all three: the first `sinks` keys (attention sinks) get exact softmax weights too

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"preset: expected one of {', '.join(PRESETS)}, got {self.preset!r}")
        self.methods = parse_methods(self.methods)
        if self.layers is not None:
            if not all(isinstance(x, int) and x >= 0 for x in self.layers):
                raise ValueError(f"layers: expected non-negative layer indices, got {self.layers!r}")
            self.layers = sorted(set(self.layers))
        if self.select is not None:
            self.select = parse_select(self.select)
        resolve_dtype(self.dtype)  # float32, bfloat16, float16 (float64 for exactness tests)
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) or \
                not 0 <= self.seed < MAX_SEED:  # the seed of every generator (seed=True ran as 1, recorded as true)
            raise InputError(f"expected an integer in [0, 2**32), got {self.seed!r}", "--seeds", "seed")
        self.seed = int(self.seed)  # a numpy integer is recorded in config.json as a number
        for name, low, default in (("window", 1, WINDOW), ("sinks", 0, SINKS)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(f"expected an integer >= {low}, got {value!r}", f"--{name}", name)
            if value != default and not self.method_options():  # it would change nothing, yet bind the run's key
                raise InputError("applies to the sliding-window methods (swa, oal-swa, global-swa) only, and "
                                 f"methods {','.join(self.methods)} have none", f"--{name}", name)
        AdaptConfig.from_dict({**self.adapt_config_dict()})  # validate early
        for method in self.adapt_overrides:
            self.adapt_config(method)
        self.zeroshot_tasks = parse_tasks(self.zeroshot_tasks)
        self.zeroshot_files = parse_task_files(self.zeroshot_files)
        if self.zeroshot_limit is not None and self.zeroshot_limit < 1:
            raise InputError(f"expected a positive number of examples, got {self.zeroshot_limit}", "--limit",
                             "zeroshot_limit")

    def _check_data_dir(self) -> None:
        """--data-dir must exist and be read: only WikiText loads from it (an ignored option would pass silently)."""
        from oal.data import default_plan
        from oal.data.sources import WIKITEXT_CONFIGS

        if not Path(self.data_dir).is_dir():
            raise InputError(f"no such folder: {self.data_dir}", "--data-dir", "data_dir")
        corpora = {self.data} | ({bs.corpus for bs in default_plan(self.preset).roles().values()}
                                 if self.plan is None else set(WIKITEXT_CONFIGS))  # a custom plan may name any
        if not corpora & set(WIKITEXT_CONFIGS):
            raise InputError(f"holds WikiText for the paper presets, and this run reads only {self.data!r} (preset "
                             f"{self.preset}): leave it out, or pass --data {WIKITEXT_CONFIGS[0]}", "--data-dir",
                             "data_dir")

    @classmethod
    def from_preset(cls, preset: str = "default", **overrides) -> RunConfig:
        """Preset values, with any explicit override (None means 'keep the preset')."""
        if preset not in PRESETS:
            raise ValueError(f"preset: expected one of {', '.join(PRESETS)}, got {preset!r}")
        p = copy.deepcopy(PRESETS[preset])
        base = {"preset": preset, "model": p["model"], "data": p["data"], "grouping": grouping_preset(preset),
                "calib": p["calib"], "adapt": p["adapt"], "zeroshot_limit": p.get("zeroshot_limit")}
        for key in ("grouping", "calib", "adapt"):
            base[key] = {**base[key], **(overrides.pop(key, None) or {})}
        base.update({k: v for k, v in overrides.items() if v is not None})
        cfg = cls(**base)
        # checked here, not on reading a recorded run whose folders may have moved (oal export needs neither)
        check_task_files(cfg.zeroshot_tasks, cfg.zeroshot_files)
        if cfg.zeroshot_dir is not None and not Path(cfg.zeroshot_dir).is_dir():
            raise InputError(f"no such folder: {cfg.zeroshot_dir}", "--zeroshot-dir", "zeroshot_dir")
        if cfg.data_dir is not None:
            cfg._check_data_dir()
        return cfg

    def method_options(self) -> dict:
        """The method settings (`oal.methods.base.method_settings`) of this run's methods: {"window", "sinks"} when
        a sliding-window method is among them, else {} (so a run without one keeps its stage keys)."""
        from oal.methods.base import get_method

        if not any(get_method(m).settings for m in self.methods):
            return {}
        return {"window": self.window, "sinks": self.sinks}

    def adapt_config_dict(self, method: str | None = None) -> dict:
        d = {**self.adapt, **(self.adapt_overrides.get(method, {}) if method else {})}
        return {**d, "seed": d.get("seed", self.seed)}

    def adapt_config(self, method: str | None = None) -> AdaptConfig:
        """The adaptation settings of `method`'s arm (the run's, with that arm's overrides)."""
        return AdaptConfig.from_dict(self.adapt_config_dict(method))

    def with_seed(self, seed: int) -> RunConfig:
        d = self.to_dict()
        d["seed"] = seed
        d["adapt"] = {k: v for k, v in d["adapt"].items() if k != "seed"}
        return RunConfig(**d)

    def to_dict(self) -> dict:
        """A JSON-able copy of every field (config.json's `config`; `from_dict` reads it back)."""
        return copy.deepcopy(asdict(self))

    @classmethod
    def from_dict(cls, d: dict) -> RunConfig:
        return from_known_keys(cls, d, "config")
