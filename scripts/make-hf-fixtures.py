#!/usr/bin/env python3
"""Writes the tiny Hugging Face model directories of tests/fixtures/hf/ (python3 + numpy).

Each directory is what `transformers`' save_pretrained writes for its family, in miniature:
config.json, the weights in the safetensors format (names and shapes as transformers
writes them; shards with model.safetensors.index.json where noted) and a byte-level BPE
tokenizer.json. Beside them, expected.safetensors holds a token sequence ("tokens", I32
[T]) and the logits of every position ("logits", F64 [T, vocab]) computed here by a numpy
forward pass that follows transformers' GPT2LMHeadModel and LlamaForCausalLM (rotate_half
RoPE, repeat_kv for grouped-query heads), in float64 from the stored (rounded) weights.

    python3 scripts/make-hf-fixtures.py [OUT_DIR]     (default: tests/fixtures/hf)

The output is deterministic; tests/test_hf_*.cpp read the committed copy, so the tests
need neither numpy nor this script.
"""
import json
import os
import struct
import sys

import numpy as np

SEQ = [5, 17, 3, 30, 8, 8, 41, 0, 22, 13, 36, 2]  # the token ids of expected.safetensors


# --- the safetensors format --------------------------------------------------------------

def bf16_bits(x):
    """float32 -> bfloat16 bit patterns, rounding to nearest even (as torch does)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def stored(x, dtype):
    """The array as the file stores it (raw bytes) and the float64 values it stands for."""
    if dtype == "F32":
        a = x.astype(np.float32)
        return a.tobytes(), a.astype(np.float64)
    if dtype == "F16":
        a = x.astype(np.float16)
        return a.tobytes(), a.astype(np.float64)
    if dtype == "BF16":
        b = bf16_bits(x)
        return b.tobytes(), bf16_value(b).astype(np.float64)
    if dtype == "F64":
        a = x.astype(np.float64)
        return a.tobytes(), a
    if dtype == "I32":
        a = x.astype(np.int32)
        return a.tobytes(), a
    raise ValueError(dtype)


ALIGN = {"F64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2}


def write_safetensors(path, tensors, metadata=None):
    """tensors: {name: (dtype, shape, raw bytes)}. Ordered as the reference writer orders
    them (descending alignment, then name), packed; the header is padded with spaces to a
    multiple of 8 bytes."""
    order = sorted(tensors, key=lambda n: (-ALIGN[tensors[n][0]], n))
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    for name in order:
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in order:
            f.write(tensors[name][2])


# --- a byte-level BPE tokenizer.json of a few tokens ----------------------------------------

def byte_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tokenizer_json(vocab_size):
    """Single bytes of " abcdefghijklmnopqrstuvwxyz" and a few merges; <|endoftext|> last."""
    b2u = byte_to_unicode()
    tokens = [b2u[ord(c)] for c in " abcdefghijklmnopqrstuvwxyz"]
    merges = [("t", "h"), ("th", "e"), (b2u[ord(" ")], "a")]
    tokens += [a + b for a, b in merges]
    vocab = {t: i for i, t in enumerate(tokens)}
    eot = len(tokens)
    assert eot < vocab_size
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": eot, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": True, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [a + " " + b for a, b in merges]},
    }


# --- the reference forward passes (float64) -----------------------------------------------

def layernorm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def rmsnorm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def gelu_new(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def silu(x):
    return x / (1.0 + np.exp(-x))


def causal_attention(q, k, v):
    """q: [H, T, D]; k, v: [H, T, D] (already repeated for grouped-query heads)."""
    T, D = q.shape[1], q.shape[2]
    s = q @ k.transpose(0, 2, 1) / np.sqrt(D)
    s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    return (s / s.sum(-1, keepdims=True)) @ v


def gpt2_forward(cfg, w, ids):
    T, C, H = len(ids), cfg["n_embd"], cfg["n_head"]
    D, eps, p = C // H, cfg["layer_norm_epsilon"], "transformer."
    x = w[p + "wte.weight"][ids] + w[p + "wpe.weight"][np.arange(T)]
    for l in range(cfg["n_layer"]):
        b = f"{p}h.{l}."
        a = layernorm(x, w[b + "ln_1.weight"], w[b + "ln_1.bias"], eps)
        qkv = a @ w[b + "attn.c_attn.weight"] + w[b + "attn.c_attn.bias"]  # Conv1D: [in, out]
        q, k, v = (qkv[:, i * C:(i + 1) * C].reshape(T, H, D).transpose(1, 0, 2) for i in range(3))
        y = causal_attention(q, k, v).transpose(1, 0, 2).reshape(T, C)
        x = x + y @ w[b + "attn.c_proj.weight"] + w[b + "attn.c_proj.bias"]
        m = layernorm(x, w[b + "ln_2.weight"], w[b + "ln_2.bias"], eps)
        f = gelu_new(m @ w[b + "mlp.c_fc.weight"] + w[b + "mlp.c_fc.bias"])
        x = x + f @ w[b + "mlp.c_proj.weight"] + w[b + "mlp.c_proj.bias"]
    x = layernorm(x, w[p + "ln_f.weight"], w[p + "ln_f.bias"], eps)
    head = w[p + "wte.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def llama_forward(cfg, w, ids):
    T, C, H, KV = len(ids), cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D, eps = C // H, cfg["rms_norm_eps"]
    inv_freq = 1.0 / (cfg["rope_theta"] ** (np.arange(0, D, 2, dtype=np.float64) / D))
    freqs = np.outer(np.arange(T, dtype=np.float64), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[None], np.sin(emb)[None]  # [1, T, D]
    x = w["model.embed_tokens.weight"][ids]
    for l in range(cfg["num_hidden_layers"]):
        b = f"model.layers.{l}."
        a = rmsnorm(x, w[b + "input_layernorm.weight"], eps)

        def proj(name, heads):
            y = a @ w[b + f"self_attn.{name}.weight"].T
            if b + f"self_attn.{name}.bias" in w:
                y = y + w[b + f"self_attn.{name}.bias"]
            return y.reshape(T, heads, D).transpose(1, 0, 2)

        q, k, v = proj("q_proj", H), proj("k_proj", KV), proj("v_proj", KV)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, H // KV, axis=0), np.repeat(v, H // KV, axis=0)  # repeat_kv
        y = causal_attention(q, k, v).transpose(1, 0, 2).reshape(T, C)
        x = x + y @ w[b + "self_attn.o_proj.weight"].T
        m = rmsnorm(x, w[b + "post_attention_layernorm.weight"], eps)
        g = silu(m @ w[b + "mlp.gate_proj.weight"].T) * (m @ w[b + "mlp.up_proj.weight"].T)
        x = x + g @ w[b + "mlp.down_proj.weight"].T
    x = rmsnorm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T


# --- the models ---------------------------------------------------------------------------

def gpt2_shapes(cfg):
    C, V, F = cfg["n_embd"], cfg["vocab_size"], cfg["n_inner"] or 4 * cfg["n_embd"]
    p = "transformer."
    s = {p + "wte.weight": (V, C), p + "wpe.weight": (cfg["n_positions"], C)}
    for l in range(cfg["n_layer"]):
        b = f"{p}h.{l}."
        s.update({b + "ln_1.weight": (C,), b + "ln_1.bias": (C,),
                  b + "attn.c_attn.weight": (C, 3 * C), b + "attn.c_attn.bias": (3 * C,),
                  b + "attn.c_proj.weight": (C, C), b + "attn.c_proj.bias": (C,),
                  b + "ln_2.weight": (C,), b + "ln_2.bias": (C,),
                  b + "mlp.c_fc.weight": (C, F), b + "mlp.c_fc.bias": (F,),
                  b + "mlp.c_proj.weight": (F, C), b + "mlp.c_proj.bias": (C,)})
    s.update({p + "ln_f.weight": (C,), p + "ln_f.bias": (C,)})
    if not cfg["tie_word_embeddings"]:
        s["lm_head.weight"] = (V, C)
    return s


def llama_shapes(cfg):
    C, V, F = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    D = C // cfg["num_attention_heads"]
    KVD = cfg["num_key_value_heads"] * D
    s = {"model.embed_tokens.weight": (V, C)}
    for l in range(cfg["num_hidden_layers"]):
        b = f"model.layers.{l}."
        s.update({b + "input_layernorm.weight": (C,),
                  b + "self_attn.q_proj.weight": (C, C), b + "self_attn.k_proj.weight": (KVD, C),
                  b + "self_attn.v_proj.weight": (KVD, C), b + "self_attn.o_proj.weight": (C, C),
                  b + "post_attention_layernorm.weight": (C,),
                  b + "mlp.gate_proj.weight": (F, C), b + "mlp.up_proj.weight": (F, C),
                  b + "mlp.down_proj.weight": (C, F)})
        if cfg.get("model_type") == "qwen2":
            s.update({b + "self_attn.q_proj.bias": (C,), b + "self_attn.k_proj.bias": (KVD,),
                      b + "self_attn.v_proj.bias": (KVD,)})
    s["model.norm.weight"] = (C,)
    if not cfg["tie_word_embeddings"]:
        s["lm_head.weight"] = (V, C)
    return s


def random_weights(rng, shapes):
    """Large enough that attention is far from uniform, so position handling shows."""
    w = {}
    for name, shape in shapes.items():
        if "norm" in name or "ln_" in name:
            w[name] = (1.0 + 0.2 * rng.standard_normal(shape)) if name.endswith("weight") else 0.2 * rng.standard_normal(shape)
        elif name.endswith("bias"):
            w[name] = 0.2 * rng.standard_normal(shape)
        else:
            w[name] = 0.5 * rng.standard_normal(shape)
    return w


def gpt2_config(tied, n_inner):
    return {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
            "bos_token_id": 30, "embd_pdrop": 0.1, "eos_token_id": 30, "initializer_range": 0.02,
            "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_embd": 16, "n_head": 4, "n_inner": n_inner,
            "n_layer": 2, "n_positions": 32, "reorder_and_upcast_attn": False, "resid_pdrop": 0.1,
            "scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True, "summary_activation": None,
            "summary_first_dropout": 0.1, "summary_proj_to_labels": True, "summary_type": "cls_index",
            "summary_use_proj": True, "tie_word_embeddings": tied, "torch_dtype": "float32",
            "transformers_version": "4.46.3", "use_cache": True, "vocab_size": 48}


def llama_config(tied, heads, kv_heads, dtype, model_type="llama"):
    c = {"architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
         "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 30, "eos_token_id": 30,
         "head_dim": 16 // heads, "hidden_act": "silu", "hidden_size": 16, "initializer_range": 0.02,
         "intermediate_size": 24, "max_position_embeddings": 32, "mlp_bias": False, "model_type": model_type,
         "num_attention_heads": heads, "num_hidden_layers": 2, "num_key_value_heads": kv_heads,
         "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500.0,
         "tie_word_embeddings": tied, "torch_dtype": dtype, "transformers_version": "4.46.3",
         "use_cache": True, "vocab_size": 48}
    if model_type == "qwen2":
        for k in ("attention_bias", "mlp_bias", "head_dim", "pretraining_tp"):
            del c[k]
        c.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": 2, "rms_norm_eps": 1e-06})
    return c


def write_model(out, name, cfg, shapes, forward, dtype, seed, shards=1):
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(seed)
    weights = random_weights(rng, shapes)
    raw, values = {}, {}
    for n, x in weights.items():
        raw[n], values[n] = stored(x, dtype)
    names = list(shapes)  # in module order, as save_pretrained splits shards
    if shards == 1:
        write_safetensors(os.path.join(d, "model.safetensors"),
                          {n: (dtype, shapes[n], raw[n]) for n in names}, {"format": "pt"})
    else:
        per = (len(names) + shards - 1) // shards
        weight_map, total = {}, 0
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i * per:(i + 1) * per]
            write_safetensors(os.path.join(d, file), {n: (dtype, shapes[n], raw[n]) for n in part}, {"format": "pt"})
            for n in part:
                weight_map[n] = file
                total += len(raw[n])
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
            f.write("\n")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        json.dump(tokenizer_json(cfg["vocab_size"]), f, ensure_ascii=False)
    logits = forward(cfg, values, np.array(SEQ))
    write_safetensors(os.path.join(d, "expected.safetensors"),
                      {"tokens": ("I32", (len(SEQ),), stored(np.array(SEQ), "I32")[0]),
                       "logits": ("F64", logits.shape, logits.astype(np.float64).tobytes())})


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "hf")
    g = gpt2_config(True, None)
    write_model(out, "gpt2", g, gpt2_shapes(g), gpt2_forward, "F32", 1)
    g = gpt2_config(False, 24)
    write_model(out, "gpt2-untied-f16", g, gpt2_shapes(g), gpt2_forward, "F16", 2)
    c = llama_config(False, 2, 1, "float32")
    write_model(out, "llama-gqa", c, llama_shapes(c), llama_forward, "F32", 3)
    c = llama_config(True, 4, 2, "bfloat16")
    write_model(out, "llama-tied-bf16-sharded", c, llama_shapes(c), llama_forward, "BF16", 4, shards=2)
    c = llama_config(False, 4, 2, "float32", "qwen2")
    write_model(out, "qwen2", c, llama_shapes(c), llama_forward, "F32", 5)


if __name__ == "__main__":
    main()
