"""The model families oal converts, by `model_type` (light: no torch, no transformers; `import oal` reads it)."""

from __future__ import annotations

__all__ = ["ENCODER_ARCHITECTURES", "SUPPORTED_ARCHITECTURES"]


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
