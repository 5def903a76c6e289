#!/usr/bin/env python3
"""PyTorch eager reference of `oobleck bench train`.

The same GPT-2 as the Candle side (pre-LN, GELU tanh, learned positions, tied LM head, fp32, no
dropout, eager attention = matmul + masked softmax + matmul), the same step (forward, backward,
global-norm clipping at 1.0, AdamW lr 3e-4, betas (0.9, 0.95), weight decay 0.1 on matrices
only), the same thread count. With `transformers` installed the model is
`GPT2LMHeadModel(attn_implementation="eager")`; without it, an equivalent nanoGPT-style module.

Prints one JSON line last: the measurements, or {"unavailable": why} (exit 0) when torch is
not installed, so the Rust side can print "n/a" instead of failing.
"""

import argparse
import json
import math
import time


def proc_status_kib(field):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def build_model(torch, a):
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=a.vocab,
            n_positions=a.seq_len,
            n_embd=a.hidden,
            n_layer=a.layers,
            n_head=a.heads,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            activation_function="gelu_new",
            tie_word_embeddings=True,
            bos_token_id=a.vocab - 1,
            eos_token_id=a.vocab - 1,
        )
        hf = GPT2LMHeadModel(cfg, attn_implementation="eager") if _accepts_attn(GPT2LMHeadModel) \
            else GPT2LMHeadModel(cfg)
        hf.config._attn_implementation = "eager"

        def forward(ids):
            return hf(input_ids=ids, use_cache=False).logits

        return hf, forward, "hf-gpt2"
    except ImportError:
        pass
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d = a.hidden
            self.ln_1 = nn.LayerNorm(d)
            self.c_attn = nn.Linear(d, 3 * d)
            self.c_proj = nn.Linear(d, d)
            self.ln_2 = nn.LayerNorm(d)
            self.c_fc = nn.Linear(d, 4 * d)
            self.mlp_proj = nn.Linear(4 * d, d)
            mask = torch.full((a.seq_len, a.seq_len), float("-inf")).triu(1)
            self.register_buffer("mask", mask, persistent=False)

        def forward(self, x):
            b, t, d = x.shape
            h = a.heads
            q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / math.sqrt(d // h) + self.mask[:t, :t]
            y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
            x = x + self.c_proj(y)
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(a.vocab, a.hidden)
            self.wpe = nn.Embedding(a.seq_len, a.hidden)
            self.h = nn.ModuleList(Block() for _ in range(a.layers))
            self.ln_f = nn.LayerNorm(a.hidden)

        def forward(self, ids):
            x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
            for blk in self.h:
                x = blk(x)
            return self.ln_f(x) @ self.wte.weight.t()

    m = Gpt()
    return m, m, "plain-torch"


def _accepts_attn(cls):
    import inspect

    try:
        return "attn_implementation" in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [
        ("layers", 6),
        ("hidden", 512),
        ("heads", 8),
        ("seq-len", 256),
        ("microbatch-size", 8),
        ("vocab", 50257),
        ("warmup", 2),
        ("steps", 5),
        ("seed", 0),
        ("threads", 0),
    ]:
        p.add_argument("--" + name, type=int, default=default)
    a = p.parse_args()
    base_kib = proc_status_kib("VmRSS")
    try:
        import torch
    except ImportError:
        print(json.dumps({"unavailable": "torch not installed"}))
        return
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model, forward, impl = build_model(torch, a)
    model.train()
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-4,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(a.seed)
    times, losses = [], []
    peak_reset = False
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            peak_reset = reset_peak_rss()
        ids = torch.randint(0, a.vocab, (a.microbatch_size, a.seq_len), generator=gen)
        tgt = torch.randint(0, a.vocab, (a.microbatch_size, a.seq_len), generator=gen)
        t0 = time.perf_counter()
        logits = forward(ids)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, a.vocab), tgt.reshape(-1))
        lv = loss.item()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        del logits, loss
        losses.append(lv)
        if step >= a.warmup:
            times.append((t1 - t0, t2 - t1, t3 - t2))
    mean = [sum(t[i] for t in times) / len(times) for i in range(3)]
    step_s = sum(mean)
    hwm = proc_status_kib("VmHWM")
    print(
        json.dumps(
            {
                "framework": f"torch {torch.__version__.split('+')[0]} {impl}",
                "threads": torch.get_num_threads(),
                "tokens_per_s": a.microbatch_size * a.seq_len / step_s,
                "step_s": step_s,
                "forward_s": mean[0],
                "backward_s": mean[1],
                "optimizer_s": mean[2],
                "first_loss": losses[0],
                "last_loss": losses[-1],
                "base_rss_bytes": base_kib * 1024 if base_kib is not None else None,
                "peak_rss_bytes": hwm * 1024 if hwm is not None else None,
                "peak_covers_timed_steps_only": peak_reset,
            }
        )
    )


if __name__ == "__main__":
    main()
