"""Hugging Face integration: the model registry (`registry`, `folders`, `provenance`, `families`), capture of
post-RoPE q/k/v (`capture`, `capture_store`), the attention swap (`attention`, `convert`, `cache`), encoders
(`encoder`) and the converted model as a transformers model (`pretrained`, `auto`)."""
