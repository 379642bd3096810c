"""PyTorch FSDP2 counterparts of fsdp2cpp's benchmark programs (tools/bench).

The trainer's model (tools/train/model.h) written in Python, same
architecture and shapes: RMSNorm in fp32, rotary attention (grouped-query
with --kv-heads), SwiGLU MLP, byte vocabulary 256 (or --vocab), no biases. It is trained as fsdp_train trains it (AdamW
betas 0.9/0.95, byte batches from the same corpus) under
torch.distributed.fsdp.fully_shard, one call per block and one on the root,
with Gloo on CPU or NCCL on CUDA, or unsharded (--no-shard). The C++
benchmarks run this script and read the one line it prints:

    RESULT {"median_step_s": ..., "peak_bytes": ..., ...}

    python fsdp2_bench.py train --nproc 2 --layers 4 --dim 512 --heads 8 \
        --seq-len 16 --global-batch 2 --steps 5 --clip 0
    python fsdp2_bench.py overhead --nproc 1 --groups 64 --steps 200
    python fsdp2_bench.py train --nproc 2 --ac full          # as fsdp_train --ac full

Modes:
  train     median step time (steps after --warmup-steps), peak memory (max
            over ranks: max RSS on CPU, allocator peak on CUDA), losses.
            --ac none|full|selective and --ac-every N checkpoint blocks 0, N,
            2N, ... as fsdp_train --ac does (see apply_activation_checkpointing).
  overhead  per-group host overhead: median step time (forward + backward)
            of --groups tiny fully_shard'ed modules minus the same model
            unsharded, divided by the number of groups.
"""

import argparse
import functools
import json
import math
import os
import resource
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rotary_tables(max_seq_len, head_dim, theta=10000.0):
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = torch.pow(theta, -exponents)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x, cos, sin):
    seq, half = x.size(-2), x.size(-1) // 2
    c, s = cos[:seq].to(x.dtype), sin[:seq].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)


class Attention(nn.Module):
    """kv_heads < heads: grouped-query attention, each key/value head serving
    heads // kv_heads consecutive query heads (repeat_interleave, as Llama's
    repeat_kv); 0: as many as heads. qkv's rows are q's, then k's, then v's."""

    def __init__(self, dim, heads, kv_heads=0):
        super().__init__()
        self.heads = heads
        self.kv_heads = kv_heads or heads
        kv_dim = self.kv_heads * (dim // heads)
        self.qkv = nn.Linear(dim, dim + 2 * kv_dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        hd = d // self.heads
        qkv = self.qkv(x).view(b, t, self.heads + 2 * self.kv_heads, hd).transpose(1, 2)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, heads, hidden, kv_heads=0):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, heads, kv_heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, layers, dim, heads, hidden, max_seq_len, vocab=256, kv_heads=0):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden, kv_heads) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        cos, sin = rotary_tables(max_seq_len, dim // heads)
        self.register_buffer("rope_cos", cos)
        self.register_buffer("rope_sin", sin)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for block in self.layers:
            h = block(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))


def hidden_size(dim, hidden):
    """fsdp_train's rule: 8/3 * dim rounded up to a multiple of 16 unless given."""
    if hidden > 0:
        return hidden
    return ((8 * dim + 2) // 3 + 15) // 16 * 16


def peak_bytes(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def max_over_ranks(value, device):
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def setup_rank(rank, args):
    # Names this process as a rank for the benchmark's malloc counter
    # (libfsdp_malloc_counter.so reads $RANK when it writes its report).
    os.environ["RANK"] = str(rank)
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not args.no_shard:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=args.nproc,
                                init_method=f"tcp://127.0.0.1:{args.port}")
    return device


# fsdp::selective_checkpoint_ops() (fsdp2/activation_checkpoint.h): the
# matrix products and the fused attention kernels, by dispatcher name. The
# benchmark programs pass the library's own list (--ac-save-ops); this is the
# default for running the script by hand.
DEFAULT_SAVE_OPS = ",".join([
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention"
])


def apply_activation_checkpointing(model, args):
    """--ac: checkpoints blocks 0, N, 2N, ... (N = --ac-every) before fully_shard, as fsdp_train --ac does.

    full: checkpoint_wrapper, i.e. torch.utils.checkpoint(use_reentrant=False)
    around the block. selective: the same with torchtitan's op-level SAC
    context: the outputs of the ops named in --ac-save-ops are kept (MUST_SAVE),
    everything else is recomputed (PREFER_RECOMPUTE). Ops are matched by their
    schema name without the overload, as fsdp2cpp's policy matches them. The
    random state is preserved (the default of both systems). --ac-early-stop
    off turns off PyTorch's early stop (by default its recomputation ends once
    the last tensor backward needs is rebuilt; fsdp2cpp's runs the whole
    block), to measure what that saves.
    """
    if args.ac == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    kwargs = {"early_stop": args.ac_early_stop == "on"}
    if args.ac == "selective":
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        save = frozenset(args.ac_save_ops.split(","))

        def policy(ctx, func, *op_args, **op_kwargs):
            schema = getattr(func, "_schema", None)
            saved = schema is not None and schema.name in save
            return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    for i, block in enumerate(model.layers):
        if i % args.ac_every == 0:
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=True, **kwargs)


def train_rank(rank, args, out):
    from torch.distributed.fsdp import fully_shard

    device = setup_rank(rank, args)
    torch.manual_seed(args.seed)
    hidden = hidden_size(args.dim, args.hidden)
    with torch.device(device):
        model = Transformer(args.layers, args.dim, args.heads, hidden, args.seq_len, args.vocab, args.kv_heads)
    apply_activation_checkpointing(model, args)
    if not args.no_shard:
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    corpus = torch.frombuffer(bytearray(open(args.data, "rb").read()), dtype=torch.uint8).long()
    rows = args.global_batch // args.nproc
    gen = torch.Generator().manual_seed(args.seed)
    times, losses = [], []
    for step in range(args.steps):
        # The global batch's rows, this rank's slice (so every world size
        # trains on the same global batch).
        starts = torch.randint(0, corpus.numel() - args.seq_len - 1, (args.global_batch,), generator=gen)
        starts = starts[rank * rows:(rank + 1) * rows]
        batch = torch.stack([corpus[s:s + args.seq_len + 1] for s in starts.tolist()]).to(device)
        start = time.perf_counter()
        optim.zero_grad()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optim.step()
        value = loss.item()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        times.append(max_over_ranks(seconds, device))
        losses.append(value)
    timed = times[args.warmup_steps:] or times
    result = {
        "median_step_s": statistics.median(timed),
        "peak_bytes": max_over_ranks(peak_bytes(device), device),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "world_size": args.nproc,
    }
    if rank == 0:
        out.put(result)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class Tiny(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width, bias=False)

    def forward(self, x):
        return self.lin(x)


class TinyStack(nn.Module):
    def __init__(self, groups, width):
        super().__init__()
        self.layers = nn.ModuleList(Tiny(width) for _ in range(groups))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def median_step(model, x, steps, warmup, device):
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        model(x).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def overhead_rank(rank, args, out):
    from torch.distributed.fsdp import fully_shard

    device = setup_rank(rank, args)
    torch.manual_seed(0)
    x = torch.randn(args.rows, args.width, device=device)
    plain = TinyStack(args.groups, args.width).to(device)
    sharded = TinyStack(args.groups, args.width).to(device)
    for layer in sharded.layers:
        fully_shard(layer)
    fully_shard(sharded)
    t_plain = max_over_ranks(median_step(plain, x, args.steps, args.warmup_steps, device), device)
    t_sharded = max_over_ranks(median_step(sharded, x, args.steps, args.warmup_steps, device), device)
    result = {
        "plain_step_s": t_plain,
        "sharded_step_s": t_sharded,
        "per_group_us": 1e6 * (t_sharded - t_plain) / args.groups,
        "world_size": args.nproc,
    }
    if rank == 0:
        out.put(result)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["train", "overhead"])
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed first steps")
    parser.add_argument("--seed", type=int, default=0)
    # train
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=0, help="key/value heads (grouped-query); 0: --heads")
    parser.add_argument("--vocab", type=int, default=256, help="at least 256 (the corpus is bytes)")
    parser.add_argument("--hidden", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--no-shard", action="store_true", help="the same model without fully_shard, one rank")
    parser.add_argument("--ac", default="none", choices=["none", "full", "selective"],
                        help="activation checkpointing of the blocks, as fsdp_train --ac")
    parser.add_argument("--ac-every", type=int, default=1, help="with --ac: checkpoint blocks 0, N, 2N, ...")
    parser.add_argument("--ac-save-ops", default=DEFAULT_SAVE_OPS,
                        help="with --ac selective: comma-separated ops whose outputs are kept (dispatcher names)")
    parser.add_argument("--ac-early-stop", default="on", choices=["on", "off"],
                        help="with --ac: torch.utils.checkpoint's early_stop (on: PyTorch's default)")
    parser.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "..", "..", "..", "data",
                                                       "tiny_corpus.txt"))
    # overhead
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--rows", type=int, default=2)
    args = parser.parse_args()
    if args.nproc < 1 or (args.no_shard and args.nproc != 1):
        parser.error("--nproc must be >= 1, and 1 with --no-shard")
    if args.global_batch % args.nproc != 0:
        parser.error("--global-batch must be divisible by --nproc")
    if args.ac_every < 1:
        parser.error("--ac-every must be >= 1")
    if args.kv_heads < 0 or (args.kv_heads and args.heads % args.kv_heads):
        parser.error(f"--kv-heads must divide --heads (got {args.heads} and {args.kv_heads})")
    if args.vocab < 256:
        parser.error(f"--vocab must be >= 256, the byte-level corpus's 256 token values (got {args.vocab})")
    args.port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    target = train_rank if args.mode == "train" else overhead_rank
    mp.spawn(target, args=(args, out), nprocs=args.nproc, join=True)
    result = out.get()
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if all(math.isfinite(v) for v in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
