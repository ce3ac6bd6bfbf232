"""A tiny GGUF file that transformers dequantises into a working model (a 1-layer Llama, a 64-token byte-pair
vocabulary, float32 tensors), written with the `gguf` package: the GGUF route without a real model's download."""

from __future__ import annotations

from pathlib import Path

import numpy as np

VOCAB, HIDDEN, HEADS, KV_HEADS, FFN = 64, 16, 2, 1, 32
TOKENS = ["<s>", "</s>", *(chr(97 + i) for i in range(26)), "ab", "bc", *(f"t{i}" for i in range(VOCAB - 30))]


def write_tiny_gguf(path: Path, license: str | None = "mit", seed: int = 0) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny llama")
    if license:
        w.add_license(license)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(1)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3] + [1] * (VOCAB - 2))  # the two special tokens are "control" tokens
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_merges(["a b", "b c"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    rng = np.random.default_rng(seed)
    kv = HIDDEN // HEADS * KV_HEADS
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,), "output.weight": (VOCAB, HIDDEN),
              "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.ffn_norm.weight": (HIDDEN,),
              "blk.0.attn_q.weight": (HIDDEN, HIDDEN), "blk.0.attn_k.weight": (kv, HIDDEN),
              "blk.0.attn_v.weight": (kv, HIDDEN), "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
              "blk.0.ffn_gate.weight": (FFN, HIDDEN), "blk.0.ffn_up.weight": (FFN, HIDDEN),
              "blk.0.ffn_down.weight": (HIDDEN, FFN)}
    for name, shape in shapes.items():
        w.add_tensor(name, (rng.standard_normal(shape) * 0.5).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
