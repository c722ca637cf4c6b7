"""A tiny Llama with random weights, written to a folder vLLM loads as a model.

Nothing is downloaded: the config is written here and the weights are drawn from a
seeded generator, so every run (and every engine of one run) gets the same model and,
decoding greedily, the same tokens. Too small to say anything sensible, big enough to
exercise vLLM's real attention, KV cache and offloading paths on a CPU.
"""

from __future__ import annotations

import json
import os

import numpy as np

LAYERS = 2
HIDDEN = 256
HEADS = 4
KV_HEADS = 4
INTERMEDIATE = 512
VOCAB = 4096
# Long enough for the test prompts plus their generated tokens.
MAX_POSITIONS = 4096
# Weights' spread: small enough that activations stay finite through two layers.
WEIGHT_STD = 0.02


def kv_bytes_per_token() -> int:
    """Bytes of K and V one token takes over all layers (float32)."""
    return 2 * LAYERS * KV_HEADS * (HIDDEN // HEADS) * 4


def write_model(folder: str, seed: int = 0) -> str:
    """Write ``config.json`` and ``model.safetensors`` into ``folder``; returns it."""
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * WEIGHT_STD).astype(np.float32)

    head_dim = HIDDEN // HEADS
    tensors = {"model.embed_tokens.weight": weight(VOCAB, HIDDEN),
               "model.norm.weight": np.ones(HIDDEN, np.float32),
               "lm_head.weight": weight(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": weight(HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": weight(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": weight(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": weight(HIDDEN, HEADS * head_dim),
            p + "mlp.gate_proj.weight": weight(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": weight(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": weight(HIDDEN, INTERMEDIATE),
            p + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
            p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
        })
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    return folder
