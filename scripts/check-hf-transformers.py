#!/usr/bin/env python3
"""esplag's Hugging Face interop against transformers itself (docs/interop.md).

In a temporary directory, for a random-initialised GPT2LMHeadModel (tied head) and a
LlamaForCausalLM (grouped-query attention, untied head, its block linears pruned 2:4), fp32:

  1. save_pretrained, plus a byte-level tokenizer.json and a validation shard of random ids
     in esplag's data format (src/data/shard.h, meta.json as `esplag data prepare` writes it);
  2. `esplag import --hf`, then `esplag eval --device cpu` (and `--device cuda` when there is a
     GPU) on those tokens, against transformers' loss on exactly the same windows
     (cpu fp32: within 1e-4 relative; cuda: within 2e-2);
  3. `esplag export --hf` of the imported run, loaded with AutoModelForCausalLM.from_pretrained:
     the same loss (1e-4);
  4. llama: `esplag export --hf --sparse-24`, decompressed by compressed-tensors (a version that
     still reads sparse-24-bitmask, <= 0.14): every weight equal to the dense export's, bit
     for bit, and the loss of the decompressed model (1e-4).

Prints a table; exits 1 on any mismatch. Usage:

  ESPLAG=build/cuda/esplag python3 scripts/check-hf-transformers.py [--keep DIR]
  python3 scripts/check-hf-transformers.py --self-test [--esplag build/cpu/esplag]

--self-test needs neither torch nor transformers: it checks the shard and tokenizer writers
and, given an esplag binary, evaluates an imported fixture on a shard written here.
"""
import argparse
import importlib.util
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile

SHARD_MAGIC = 20240520
VOCAB = 512
SEQ, BATCH, BATCHES = 64, 4, 3


# ---- esplag's data format (no torch) ----

def write_shard(path, tokens):
    """A token shard: 256 little-endian int32 header (magic, version 1 = uint16 ids, count)."""
    assert all(0 <= t < 65536 for t in tokens)
    header = [SHARD_MAGIC, 1, len(tokens)] + [0] * 253
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack("<%dH" % len(tokens), *tokens))


def read_shard(path):
    with open(path, "rb") as f:
        data = f.read()
    header = struct.unpack_from("<256i", data, 0)
    assert header[0] == SHARD_MAGIC and header[1] == 1, header[:3]
    assert len(data) == 1024 + 2 * header[2], "shard size does not match its header"
    return list(struct.unpack_from("<%dH" % header[2], data, 1024))


def write_dataset(data_dir, tokens, vocab_size, tokenizer):
    """val.bin and meta.json as `esplag data prepare` writes them (esplag eval reads the split's
    shards, the vocabulary and the tokenizer, which must be the checkpoint's)."""
    os.makedirs(data_dir, exist_ok=True)
    write_shard(os.path.join(data_dir, "val_000000.bin"), tokens)
    meta = {"format": "esplag-token-shards", "tokenizer": tokenizer, "vocab_size": vocab_size, "eot_token": -1,
            "shard_version": 1, "source": "random ids", "source_bytes": 0, "separator": "", "documents": 0,
            "val_fraction": 1.0, "train_tokens": 0, "val_tokens": len(tokens), "train_shards": [],
            "val_shards": ["val_000000.bin"]}
    with open(os.path.join(data_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)


def windows(tokens, n, seq=SEQ):
    """esplag's validation windows: the first n non-overlapping runs of seq + 1 tokens, in order."""
    return [tokens[i * (seq + 1):(i + 1) * (seq + 1)] for i in range(n)]


def bytes_to_unicode():
    """GPT-2's byte-level alphabet: every byte as a printable character (make-hf-fixtures.py's)."""
    spec = importlib.util.spec_from_file_location("make_hf_fixtures", os.path.join(os.path.dirname(__file__),
                                                                                     "make-hf-fixtures.py"))
    fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixtures)
    return fixtures.byte_to_unicode()


def write_byte_tokenizer(path):
    """A byte-level BPE without merges (ids 0..255 the bytes, 256 <|endoftext|>) as tokenizer.json."""
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tok = {"version": "1.0", "truncation": None, "padding": None,
           "added_tokens": [{"id": 256, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True}],
           "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                     "vocab": vocab, "merges": []}}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)


def esplag(binary, *args):
    r = subprocess.run([binary, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("esplag %s failed (%d): %s" % (" ".join(args), r.returncode, (r.stderr or r.stdout).strip()))
    return r.stdout


def esplag_loss(binary, run, data, device, seq=SEQ):
    out = esplag(binary, "eval", "--checkpoint", run, "--data", data, "--split", "val", "--batches", str(BATCHES),
                 "--batch", str(BATCH), "--seq", str(seq), "--device", device, "--json")
    return json.loads(out)


def self_test(binary):
    import random
    tmp = tempfile.mkdtemp(prefix="check-hf-selftest-")
    try:
        rng = random.Random(0)
        tokens = [rng.randrange(48) for _ in range(BATCHES * BATCH * (SEQ + 1) + 7)]
        write_shard(os.path.join(tmp, "s.bin"), tokens)
        assert read_shard(os.path.join(tmp, "s.bin")) == tokens
        assert os.path.getsize(os.path.join(tmp, "s.bin")) == 1024 + 2 * len(tokens)
        w = windows(tokens, 2)
        assert w[1][0] == tokens[SEQ + 1] and len(w[1]) == SEQ + 1
        write_byte_tokenizer(os.path.join(tmp, "tokenizer.json"))
        with open(os.path.join(tmp, "tokenizer.json"), encoding="utf-8") as f:
            vocab = json.load(f)["model"]["vocab"]
        assert sorted(vocab.values()) == list(range(256)) and vocab["Ġ"] == 32 and vocab["A"] == 65
        print("shard and tokenizer writers: ok")
        if binary:
            # A fixture imported and evaluated on a shard written here: esplag reads the data.
            src = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            fixture = os.path.join(src, "tests", "fixtures", "hf", "llama-gqa")
            run, data = os.path.join(tmp, "run"), os.path.join(tmp, "data")
            esplag(binary, "import", "--hf", fixture, "--out", run)
            write_dataset(data, tokens, 48, os.path.join(fixture, "tokenizer.json"))
            r = esplag_loss(binary, run, data, "cpu", seq=16)  # the fixture's max_seq_len is 32
            assert r["batches"] == BATCHES and math.isfinite(r["loss"]), r
            print("esplag eval on the written shard: ok (loss %.4f, %d batches)" % (r["loss"], r["batches"]))
    finally:
        shutil.rmtree(tmp)
    return 0


# ---- the check against transformers (torch) ----

def main_check(binary, work):
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    from safetensors.torch import load_file

    rows = []  # (model, check, esplag, reference, tolerance, ok)

    def compare(model, check, got, want, rel):
        ok = abs(got - want) <= rel * abs(want)
        rows.append((model, check, "%.6f" % got, "%.6f" % want, "%g rel" % rel, ok))

    def note(model, check, text, ok):
        rows.append((model, check, text, "", "", ok))

    def hf_loss(model, tokens, device="cpu"):
        model = model.to(device).eval()
        total = 0.0
        with torch.no_grad():
            w = torch.tensor(windows(tokens, BATCHES * BATCH), dtype=torch.long, device=device)
            for b in range(BATCHES):
                x = w[b * BATCH:(b + 1) * BATCH]
                logits = model(x[:, :-1]).logits.float()
                total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).item()
        return total / BATCHES

    def prune_2_of_4(model):
        """Magnitude 2:4 along the input features of every block linear (rows of [out, in])."""
        with torch.no_grad():
            for name, m in model.named_modules():
                if isinstance(m, torch.nn.Linear) and ".layers." in name:
                    w = m.weight.view(-1, 4)
                    drop = w.abs().topk(2, dim=1, largest=False).indices
                    w.scatter_(1, drop, 0.0)

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCHES * BATCH * (SEQ + 1) + 5,), generator=gen).tolist()
    models = {
        "gpt2": GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                                           initializer_range=0.1, tie_word_embeddings=True)),
        "llama": LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-5,
                                              initializer_range=0.1, tie_word_embeddings=False)),
    }
    prune_2_of_4(models["llama"])
    cuda = torch.cuda.is_available()
    for name, model in models.items():
        model = model.float().eval()
        d = os.path.join(work, name)
        hf_dir, run, data = d + "/hf", d + "/run", d + "/data"
        model.save_pretrained(hf_dir, safe_serialization=True)
        write_byte_tokenizer(hf_dir + "/tokenizer.json")
        write_dataset(data, tokens, VOCAB, os.path.abspath(hf_dir + "/tokenizer.json"))
        reference = hf_loss(model, tokens)

        esplag(binary, "import", "--hf", hf_dir, "--out", run)
        compare(name, "import, eval cpu", esplag_loss(binary, run, data, "cpu")["loss"], reference, 1e-4)
        if cuda:
            r = esplag_loss(binary, run, data, "cuda")
            if r["device"] == "cuda":
                compare(name, "import, eval cuda", r["loss"], reference, 2e-2)
            else:
                note(name, "import, eval cuda", "esplag evaluated on " + r["device"], False)

        exported = d + "/export"
        esplag(binary, "export", "--checkpoint", run, "--hf", exported)
        back = AutoModelForCausalLM.from_pretrained(exported, torch_dtype=torch.float32)
        compare(name, "export, from_pretrained", hf_loss(back, tokens), reference, 1e-4)

        if name != "llama":
            continue
        sparse = d + "/export-2of4"
        esplag(binary, "export", "--checkpoint", run, "--hf", sparse, "--sparse-24")
        try:
            import compressed_tensors
            from compressed_tensors.compressors import ModelCompressor
        except ImportError as e:
            note(name, "2:4 export, compressed-tensors", "skipped: compressed_tensors not importable (%s)" % e, True)
            continue
        compressor = ModelCompressor.from_pretrained(sparse)
        if compressor is None or getattr(compressor, "sparsity_compressor", None) is None:
            note(name, "2:4 export, compressed-tensors",
                 "compressed-tensors %s reads no sparse-24-bitmask (use <= 0.14, e.g. 0.12.2)"
                 % compressed_tensors.__version__, False)
            continue
        decompressed = dict(compressor.sparsity_compressor.decompress(sparse))
        dense = load_file(exported + "/model.safetensors")
        same = set(decompressed) == set(dense) and all(torch.equal(decompressed[k], dense[k]) for k in dense)
        note(name, "2:4 export, decompressed == dense export",
             "%d tensors, %s" % (len(dense), "equal" if same else "DIFFERENT"), same)
        pruned = LlamaForCausalLM(models["llama"].config)
        pruned.load_state_dict(decompressed)
        compare(name, "2:4 export, decompressed loss", hf_loss(pruned.float(), tokens), reference, 1e-4)

    widths = [max(len(str(r[i])) for r in rows + [("model", "check", "esplag", "transformers", "tolerance", "")])
              for i in range(5)]
    line = "  ".join("%-*s" % (w, h) for w, h in zip(widths, ("model", "check", "esplag", "transformers", "tolerance")))
    print(line + "  result")
    for r in rows:
        print("  ".join("%-*s" % (w, v) for w, v in zip(widths, r[:5])) + "  " + ("ok" if r[5] else "MISMATCH"))
    return 0 if all(r[5] for r in rows) else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--esplag", default=os.environ.get("ESPLAG", ""), help="the esplag binary (default: $ESPLAG)")
    p.add_argument("--self-test", action="store_true", help="check the writers without torch")
    p.add_argument("--keep", default="", help="work in this directory and keep it (default: a removed temp dir)")
    a = p.parse_args()
    if a.self_test:
        return self_test(a.esplag)
    if not a.esplag or not os.access(a.esplag, os.X_OK):
        p.error("give the esplag binary with --esplag PATH or ESPLAG=PATH")
    binary = os.path.abspath(a.esplag)
    if a.keep:
        os.makedirs(a.keep, exist_ok=True)
        return main_check(binary, a.keep)
    with tempfile.TemporaryDirectory(prefix="check-hf-") as work:
        return main_check(binary, work)


if __name__ == "__main__":
    sys.exit(main())
