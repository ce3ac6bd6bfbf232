"""Converted models as transformers model types: "oal_<family>" configs and models for the Auto classes.

A converted model is saved with `model_type: "oal_qwen2"` (etc.): a subclass of the family's config that carries
the conversion under `config.oal`, and `architectures: ["OALQwen2ForCausalLM"]`, a subclass of the family's causal
LM whose __init__ converts the recorded layers (`models.pretrained`). Plain transformers does not know these model
types, so loading such a folder without `oal` fails loudly instead of silently returning softmax attention.

Encoders (BERT family, `models.encoder`) are saved as "oal_bert" (etc.) the same way and reload through
`AutoModel`, which gives the converted base encoder ("OALBertModel").

`import oal` registers them with AutoConfig / AutoModelForCausalLM / AutoModel without importing transformers
(which would make `import oal`, and every `oal` command, pay for torch): `install()` puts an import hook in front of
transformers' modules, and once an import that loaded transformers' `configuration_auto` has finished (the
outermost transformers import returned, so no transformers module is half imported), it registers the config
types, which need only the families' configuration modules, and removes itself. The model class of a family is
registered when a config of its "oal_" type is built: by then user code is running rather than an import, so
importing the family's modeling module is safe.
"""

from __future__ import annotations

import _thread  # threading.local without threading's imports
import functools
import sys

from oal.models.families import ENCODER_ARCHITECTURES, SUPPORTED_ARCHITECTURES, auto_class

__all__ = ["ENCODER_FAMILIES", "FAMILIES", "PREFIX", "base_model_type", "converted_class", "install", "make_saveable",
           "register_config", "register_model"]

# Registered on import: the causal-LM families and the encoders oal converts (encoders register with AutoModel).
# Other families are registered on demand (`oal.convert` / `oal.load` call `register_model` for theirs).
FAMILIES = tuple(SUPPORTED_ARCHITECTURES)
ENCODER_FAMILIES = tuple(ENCODER_ARCHITECTURES)
PREFIX = "oal_"
_CONFIG_AUTO = "transformers.models.auto.configuration_auto"

_config_classes: dict[str, type] = {}
_model_classes: dict[str, type] = {}


def base_model_type(model_type: str) -> str:
    """"oal_qwen2" -> "qwen2"; ValueError for anything else."""
    if not isinstance(model_type, str) or not model_type.startswith(PREFIX) or len(model_type) == len(PREFIX):
        raise ValueError(f"model_type: expected 'oal_<family>' (a converted model), got {model_type!r}")
    return model_type[len(PREFIX):]


def register_config(family: str) -> type:
    """The "oal_<family>" config class (built and registered with AutoConfig once)."""
    if family in _config_classes:
        return _config_classes[family]
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, AutoConfig

    if family not in CONFIG_MAPPING:
        raise ValueError(f"model_type: transformers has no model type {family!r}")
    base = CONFIG_MAPPING[family]

    def __post_init__(self, **kwargs):
        base.__post_init__(self, **kwargs)
        register_model(family)  # a config of this type is being built: its model class is about to be needed

    cls = type(f"OAL{base.__name__}", (base,), {
        "model_type": PREFIX + family, "oal_family": family, "__module__": __name__, "__post_init__": __post_init__,
        "__doc__": f"{base.__name__} of a converted model: the conversion is in `config.oal`.",
    })
    globals()[cls.__name__] = cls  # importable by name (pickle)
    AutoConfig.register(cls.model_type, cls, exist_ok=True)
    _config_classes[family] = cls
    return cls


def register_model(family: str) -> type:
    """The converted causal-LM class of `family` (built and registered with AutoModelForCausalLM once); for an
    encoder family, the converted base encoder (registered with AutoModel)."""
    if family in _model_classes:
        return _model_classes[family]
    config_cls = register_config(family)
    base_config = config_cls.__mro__[1]
    auto, mapping, what = auto_class(family)
    if base_config not in mapping:
        raise ValueError(f"model_type: transformers has no {what} for {family!r}")
    cls = converted_class(mapping[base_config])
    auto.register(config_cls, cls, exist_ok=True)
    _model_classes[family] = cls
    return cls


@functools.cache
def converted_class(base_cls: type) -> type:
    """`OAL<Base>`: `base_cls` (a family's causal LM or base encoder) with the converted form's __init__ / save /
    load (`models.pretrained.ConvertedModelMixin`) and its "oal_<family>" config class."""
    from oal.models.pretrained import ConvertedModelMixin

    if issubclass(base_cls, ConvertedModelMixin):
        return base_cls
    family = base_cls.config_class.model_type
    config_cls = register_config(family)
    cls = type(f"OAL{base_cls.__name__}", (ConvertedModelMixin, base_cls),
               {"config_class": config_cls, "__module__": __name__,
                "__doc__": f"{base_cls.__name__} with converted attention layers (see oal.models.pretrained)."})
    globals()[cls.__name__] = cls  # importable by name (pickle)
    return cls


def make_saveable(model):
    """Give a converted HF model its converted class, so its own save_pretrained writes the converted form."""
    from oal.models.pretrained import ConvertedModelMixin

    if not isinstance(model, ConvertedModelMixin):
        model.__class__ = converted_class(type(model))
        _record_outputs_as(model)
    family = getattr(model.config, "model_type", "")
    if family in FAMILIES or family in ENCODER_FAMILIES:
        register_model(family)  # transformers' pipeline() knows the class (it logged "not supported" otherwise)
    return model


def _record_outputs_as(model) -> None:
    """transformers 5 finds a model's output-capture hooks (output_hidden_states, output_attentions) under the name of
    the class its __init__ ran as: a BertModel given its converted class afterwards returned hidden_states=None. The
    registry is private (a dict keyed by str(class); a subclass of one from 5.2x), so a missing one changes nothing."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY as registry
    except ImportError:
        return
    can_record = getattr(model, "_can_record_outputs", None)
    if isinstance(registry, dict) and can_record:
        dict.__setitem__(registry, str(model.__class__), can_record)


# ----------------------------------------------------------------------------------------------- post-import hook


def _register_configs() -> None:
    global _finder
    if _finder is not None:
        sys.meta_path.remove(_finder)
        _finder = None
    for family in FAMILIES + ENCODER_FAMILIES:
        try:
            register_config(family)
        except Exception as exc:  # never break the user's import of transformers; loading then fails loudly
            import logging

            logging.getLogger("oal").warning("could not register the oal_%s model type with transformers: %s",
                                             family, exc)


_depth = _thread._local()  # transformers modules being imported by this thread, nested


class _Counted:  # an importlib loader (duck-typed: importlib.abc alone costs more than the rest of `import oal`)
    """Wraps the loader of a transformers module; registers once the outermost transformers import is done."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        _depth.n = getattr(_depth, "n", 0) + 1
        try:
            self._loader.exec_module(module)
        finally:
            _depth.n -= 1
        # Not earlier: a family's configuration module imported while another transformers module is half
        # imported can need it (configuration_qwen2's docstring decorator reads modeling_auto, for one).
        if _depth.n == 0 and _finder is not None and _CONFIG_AUTO in sys.modules:
            _register_configs()

    def __getattr__(self, name):  # get_source, get_resource_reader, ... of the real loader
        return getattr(self._loader, name)


class _TransformersFinder:  # an importlib meta path finder
    """Finds transformers' modules with the other finders and wraps their loaders in `_Counted`."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "transformers" and not fullname.startswith("transformers."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Counted(spec.loader)
                return spec
        return None


_finder: _TransformersFinder | None = None
_installed = False


def install() -> None:
    """Register the "oal_<family>" types now if transformers' Auto classes are loaded, else once they are."""
    global _finder, _installed
    if _installed:
        return
    _installed = True
    if _CONFIG_AUTO in sys.modules:
        _register_configs()
    else:
        _finder = _TransformersFinder()
        sys.meta_path.insert(0, _finder)
