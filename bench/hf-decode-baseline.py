"""PyTorch `transformers` generation of a llama-1b-shaped model (random weights, bf16), the
baseline of `esplag bench generate` (docs/cli.md, GPU generation): a static KV cache, with
which `generate` compiles the decode step itself (`torch.compile`, CUDA graphs), greedy, batch 1 and 32,
128 prompt tokens and 128 new ones. Prints prefill tokens/s (one forward of the prompts)
and decode tokens/s (the new tokens of every sequence over the time after the prefill),
each the median of 3 timed runs after the compiling ones.

  python3 bench/hf-decode-baseline.py [--batch 1,32] [--prompt-len 128] [--new-tokens 128]
"""
import argparse
import statistics
import time

import torch
import transformers


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    a = ap.parse_args()
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                   num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                                   max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("batch,prompt,new,prefill_tok_s,decode_tok_s")
    for batch in [int(b) for b in a.batch.split(",")]:
        prompt = torch.randint(0, cfg.vocab_size, (batch, a.prompt_len), device="cuda")
        mask = torch.ones_like(prompt)

        def gen(n):
            with torch.no_grad():
                model.generate(prompt, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               cache_implementation="static", pad_token_id=0)

        for _ in range(2):  # compiles (prefill and decode shapes) and warms up
            gen(1)
            gen(a.new_tokens)
        prefill = statistics.median(timed(lambda: gen(1)) for _ in range(3))
        total = statistics.median(timed(lambda: gen(a.new_tokens)) for _ in range(3))
        decode = max(total - prefill, 1e-9)
        print(f"{batch},{a.prompt_len},{a.new_tokens},{batch * a.prompt_len / prefill:.0f},"
              f"{batch * (a.new_tokens - 1) / decode:.0f}")


if __name__ == "__main__":
    main()
