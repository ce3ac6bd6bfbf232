"""The model families oal converts, by `model_type` (light: no torch, no transformers; `import oal` reads it)."""

from __future__ import annotations

__all__ = ["ENCODER_ARCHITECTURES", "SUPPORTED_ARCHITECTURES", "auto_class", "is_encoder_type"]


# model_type -> causal-LM class name. These families expose `model.model.layers[i].self_attn` and call the
# attention function through AttentionInterface with post-RoPE q/k and native GQA k/v.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


# model_type -> the base model class; every one of them keeps `base_model.encoder.layer[i].attention.self`.
ENCODER_ARCHITECTURES: dict[str, str] = {
    "bert": "BertModel",
    "roberta": "RobertaModel",
    "xlm-roberta": "XLMRobertaModel",
    "camembert": "CamembertModel",
    "electra": "ElectraModel",
}


def is_encoder_type(model_type) -> bool:
    """Whether a config's `model_type`, plain ("bert") or converted ("oal_bert"), is a supported encoder's."""
    return str(model_type).removeprefix("oal_") in ENCODER_ARCHITECTURES


def auto_class(family: str) -> tuple:
    """(Auto class, its model mapping, what it loads) of a converted `family`: an encoder's base model, else the
    causal LM; what `oal.models.auto.register_model` registers, and the only class a saved folder reloads as
    (transformers is imported when this is called)."""
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    if family in ENCODER_ARCHITECTURES:
        return AutoModel, MODEL_MAPPING, "base model"
    return AutoModelForCausalLM, MODEL_FOR_CAUSAL_LM_MAPPING, "causal LM"
