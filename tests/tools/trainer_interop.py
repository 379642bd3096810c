"""The Python side of FsdpTrainCheckpoint's PyTorch tests: PyTorch's own
readers open fsdp_train's checkpoints, a checkpoint PyTorch writes with the
trainer's FQNs starts a trainer run, PyTorch's AdamW continues the trainer's
optimizer state, and a plain-PyTorch replica of the trainer's model computes
the trainer's loss.

    python trainer_interop.py compare SHARDED_MODEL_DIR HF_DIR
        safetensors.torch.load_file reads the --export-hf files, PyTorch's
        HuggingFaceStorageReader (dcp.load, no_dist) reads the sharded
        checkpoint's model/ folder, and every tensor agrees bit for bit.
    python trainer_interop.py rewrite HF_DIR OUT_DIR WORLD
        WORLD gloo ranks load the export, shard every tensor with DTensor
        Shard(0) and save it with HuggingFaceStorageWriter(save_distributed=True).
    python trainer_interop.py adamw STEP_K_DIR STEP_K1_DIR
        Two consecutive checkpoints (steps k and k+1) of one run. PyTorch's
        torch.optim.AdamW is loaded with step k's parameters and optimizer
        state (state.<fqn>.exp_avg / exp_avg_sq / step and the manifest's
        param_groups) and takes step k+1 with the gradient the trainer's
        AdamW took it with; its parameters and state must equal step k+1's.
        The trainer's model is not rebuilt here (its data sampler is a C++
        std::mt19937_64), so the gradient is the one step k+1's exp_avg
        implies: g = (exp_avg[k+1] - beta1 * exp_avg[k]) / (1 - beta1).
        exp_avg_sq, step and the parameters then check every key's meaning
        against PyTorch's update rule.
    python trainer_interop.py loss STEP_K_DIR RUN_JSON CORPUS --world N --seed S
            --global-batch B --seq-len T --heads H [--kv-heads K]
        The plain-PyTorch replica of the trainer's model (Transformer in
        tools/bench/python/fsdp2_bench.py; its shape read from the weights
        and --heads / --kv-heads) is loaded with step k's parameters and
        computes step k+1's loss on global batch k+1 (the trainer's sampler,
        std::seed_seq and std::mt19937_64, rebuilt below), each of the N
        ranks' rows apart and their mean taken as the trainer does: it must
        equal the loss RUN_JSON records for step k+1 bit for bit.

Exits non-zero with a message on any mismatch.
"""

import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "checkpoint"))
import interop  # noqa: E402  (the checkpoint tests' workarounds for a venv without numpy)


def load_export(hf_dir):
    from safetensors.torch import load_file

    with open(os.path.join(hf_dir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    tensors = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(os.path.join(hf_dir, name)))
    if set(tensors) != set(index["weight_map"]):
        sys.exit(f"the export's files hold {sorted(tensors)}, its index lists {sorted(index['weight_map'])}")
    return tensors


def compare(sharded_dir, hf_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    exported = load_export(hf_dir)
    # The global shapes the sharded checkpoint's chunks cover: an export that
    # wrote only some rows of a tensor must not pass as a smaller tensor.
    shapes = {key: list(md.size) for key, md in
              HuggingFaceStorageReader(sharded_dir).read_metadata().state_dict_metadata.items()}
    if set(shapes) != set(exported):
        sys.exit(f"keys differ between the sharded checkpoint and the export: {sorted(set(shapes) ^ set(exported))}")
    for key, value in exported.items():
        if list(value.shape) != shapes[key]:
            sys.exit(f"MISMATCH {key}: the export has shape {list(value.shape)}, the sharded checkpoint {shapes[key]}")
    sd = {key: torch.zeros_like(value) for key, value in exported.items()}
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(sharded_dir), no_dist=True)
    for key, value in exported.items():
        if not torch.equal(sd[key], value):
            sys.exit(f"MISMATCH {key}: max abs diff {(sd[key].double() - value.double()).abs().max().item()}")
    if not any(key.startswith("layers.") for key in exported):
        sys.exit(f"no block parameters among {sorted(exported)}")
    one_d = sum(1 for value in exported.values() if value.dim() == 1)
    print(f"compare: {len(exported)} tensors equal in the sharded checkpoint and the export ({one_d} of them 1-D)")


def _rewrite_rank(rank, world, init_file, hf_dir, out_dir):
    interop._object_collectives_without_numpy()
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    sd = {key: distribute_tensor(value, mesh, [Shard(0)]) if value.dim() > 0 else value
          for key, value in load_export(hf_dir).items()}
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(out_dir, save_distributed=True))
    dist.barrier()
    dist.destroy_process_group()
    interop.leave_rank()


def rewrite(hf_dir, out_dir, world):
    import torch.multiprocessing as mp

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rewrite_rank, args=(world, os.path.join(tmp, "init"), hf_dir, out_dir), nprocs=world, join=True)
    print(f"rewrite: {sorted(os.listdir(out_dir))}")


def read_folder(folder):
    """Every tensor of a sharded folder (model/ or optim/), read with PyTorch's
    HuggingFaceStorageReader (dcp.load, no_dist) at the global shapes its
    metadata reports."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    metadata = HuggingFaceStorageReader(folder).read_metadata()
    sd = {key: torch.zeros(md.size, dtype=md.properties.dtype) for key, md in metadata.state_dict_metadata.items()}
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(folder), no_dist=True)
    return sd


def close(name, got, expected, rtol, atol_fraction):
    """allclose with an absolute tolerance relative to the tensor's scale."""
    got, expected = got.double(), expected.double()
    atol = atol_fraction * max(expected.abs().max().item(), 1e-30)
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=rtol, atol=atol):
        diff = (got - expected).abs().max().item() if got.shape == expected.shape else float("nan")
        sys.exit(f"MISMATCH {name}: max abs diff {diff} (scale {expected.abs().max().item()}, rtol {rtol}, "
                 f"atol {atol})")


def adamw(step_k_dir, step_k1_dir):
    with open(os.path.join(step_k1_dir, "manifest.json")) as f:
        manifest = json.load(f)
    groups = manifest["extra"]["param_groups"]
    if len(groups) != 1:
        sys.exit(f"expected one param group, got {groups}")
    group = groups[0]
    fqns = group["params"]
    model_k, model_k1 = read_folder(os.path.join(step_k_dir, "model")), read_folder(os.path.join(step_k1_dir, "model"))
    optim_k, optim_k1 = read_folder(os.path.join(step_k_dir, "optim")), read_folder(os.path.join(step_k1_dir, "optim"))
    expected_keys = {f"state.{fqn}.{name}" for fqn in fqns for name in ("exp_avg", "exp_avg_sq", "step")}
    for which, osd in (("k", optim_k), ("k+1", optim_k1)):
        if set(osd) != expected_keys:
            sys.exit(f"optimizer keys at step {which}: {sorted(set(osd) ^ expected_keys)} differ from AdamW's")

    beta1, beta2 = group["betas"]
    params = [torch.nn.Parameter(model_k[fqn].clone()) for fqn in fqns]
    optim = torch.optim.AdamW(params, lr=group["lr"], betas=(beta1, beta2), eps=group["eps"],
                              weight_decay=group["weight_decay"], amsgrad=group["amsgrad"], foreach=False)
    # torch.optim's own state dict format: state by parameter index, step a
    # float32 0-dim tensor.
    optim.load_state_dict({
        "state": {i: {name: optim_k[f"state.{fqn}.{name}"].clone() for name in ("step", "exp_avg", "exp_avg_sq")}
                  for i, fqn in enumerate(fqns)},
        "param_groups": [{**{k: v for k, v in optim.param_groups[0].items() if k != "params"},
                          "params": list(range(len(fqns)))}],
    })
    for p, fqn in zip(params, fqns):
        m_k, m_k1 = optim_k[f"state.{fqn}.exp_avg"].double(), optim_k1[f"state.{fqn}.exp_avg"].double()
        p.grad = ((m_k1 - beta1 * m_k) / (1 - beta1)).to(p.dtype)
    optim.step()

    for p, fqn in zip(params, fqns):
        state = optim.state[p]
        saved_step = optim_k1[f"state.{fqn}.step"]
        if saved_step.dim() != 0 or saved_step.dtype != torch.float32 or state["step"].item() != saved_step.item():
            sys.exit(f"MISMATCH state.{fqn}.step: PyTorch {state['step']}, trainer {saved_step}")
        # exp_avg agrees by construction of the gradient; exp_avg_sq (which
        # PyTorch computes from that gradient and step k's exp_avg_sq) and the
        # parameters (moved by exp_avg / sqrt(exp_avg_sq)) carry the check.
        close(f"state.{fqn}.exp_avg", state["exp_avg"], optim_k1[f"state.{fqn}.exp_avg"], 1e-4, 1e-6)
        close(f"state.{fqn}.exp_avg_sq", state["exp_avg_sq"], optim_k1[f"state.{fqn}.exp_avg_sq"], 1e-3, 1e-5)
        # The update (lr-sized) must match to a small part of itself.
        update = (model_k1[fqn].double() - model_k[fqn].double()).abs().max().item()
        if update == 0:
            sys.exit(f"{fqn} did not change between the two checkpoints")
        got = p.detach().double()
        diff = (got - model_k1[fqn].double()).abs().max().item()
        if diff > 1e-3 * update + 1e-6 * model_k1[fqn].abs().max().item():
            sys.exit(f"MISMATCH {fqn} after PyTorch's AdamW step: max abs diff {diff}, update size {update}")
    step = int(optim_k1[f"state.{fqns[0]}.step"].item())
    print(f"adamw: {len(fqns)} parameters, PyTorch's AdamW step {step} equals the trainer's (exp_avg, exp_avg_sq, "
          f"step, parameters)")


MASK32, MASK64 = (1 << 32) - 1, (1 << 64) - 1


def seed_seq_generate(seeds, n):
    """std::seed_seq(seeds).generate() of n 32-bit words ([rand.util.seedseq])."""
    out = [0x8B8B8B8B] * n
    s = len(seeds)
    t = 11 if n >= 623 else 7 if n >= 68 else 5 if n >= 39 else 3 if n >= 7 else (n - 1) // 2
    p = (n - t) // 2
    q = p + t
    m = max(s + 1, n)

    def mix(x):
        return x ^ (x >> 27)

    for k in range(m):
        r1 = (1664525 * mix(out[k % n] ^ out[(k + p) % n] ^ out[(k - 1) % n])) & MASK32
        r2 = (r1 + (s if k == 0 else (k % n + seeds[k - 1] if k <= s else k % n))) & MASK32
        out[(k + p) % n] = (out[(k + p) % n] + r1) & MASK32
        out[(k + q) % n] = (out[(k + q) % n] + r2) & MASK32
        out[k % n] = r2
    for k in range(m, m + n):
        r3 = (1566083941 * mix((out[k % n] + out[(k + p) % n] + out[(k - 1) % n]) & MASK32)) & MASK32
        r4 = (r3 - k % n) & MASK32
        out[(k + p) % n] ^= r3
        out[(k + q) % n] ^= r4
        out[k % n] = r4
    return out


class MT19937_64:
    """std::mt19937_64 seeded from a std::seed_seq ([rand.eng.mers])."""

    N, M = 312, 156

    def __init__(self, seeds):
        words = seed_seq_generate(seeds, 2 * self.N)
        self.state = [words[2 * i] | (words[2 * i + 1] << 32) for i in range(self.N)]
        if self.state[0] >> 31 == 0 and not any(self.state[1:]):
            self.state[0] = 1 << 63
        self.index = self.N

    def __call__(self):
        if self.index >= self.N:
            for i in range(self.N):
                y = (self.state[i] & ~((1 << 31) - 1) & MASK64) | (self.state[(i + 1) % self.N] & ((1 << 31) - 1))
                self.state[i] = self.state[(i + self.M) % self.N] ^ (y >> 1) ^ (0xB5026F5AA96619E9 if y & 1 else 0)
            self.index = 0
        y = self.state[self.index]
        self.index += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        return (y ^ (y >> 43)) & MASK64


def batch_offsets(seed, step, global_batch, seq_len, corpus_bytes):
    """fsdp_train::BatchSampler::offsets(step) (tools/train/data.cc)."""
    s, k = seed & MASK64, step & MASK64
    gen = MT19937_64([s & MASK32, s >> 32, k & MASK32, k >> 32])
    return [gen() % (corpus_bytes - seq_len) for _ in range(global_batch)]


def replica_loss(step_k_dir, run_json, corpus_path, args):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "bench",
                                    "python"))
    import torch.nn.functional as F
    from fsdp2_bench import Transformer

    torch.set_num_threads(1)
    with open(os.path.join(step_k_dir, "manifest.json")) as f:
        step = json.load(f)["step"] + 1
    with open(run_json) as f:
        recorded = {s["step"]: s["loss"] for s in json.load(f)["steps"]}
    if step not in recorded:
        sys.exit(f"{run_json} records no step {step} (steps {sorted(recorded)})")
    weights = read_folder(os.path.join(step_k_dir, "model"))
    vocab, dim = weights["tok_embeddings.weight"].shape
    layers = len({key.split(".")[1] for key in weights if key.startswith("layers.")})
    hidden = weights["layers.0.feed_forward.w1.weight"].shape[0]
    model = Transformer(layers, dim, args.heads, hidden, args.seq_len, vocab, args.kv_heads)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if set(missing) - {"rope_cos", "rope_sin"} or unexpected:
        sys.exit(f"the replica's parameters differ from the checkpoint's: missing {missing}, unexpected {unexpected}")

    corpus = torch.frombuffer(bytearray(open(corpus_path, "rb").read()), dtype=torch.uint8)
    offsets = batch_offsets(args.seed, step, args.global_batch, args.seq_len, corpus.numel())
    rows = args.global_batch // args.world
    losses = []
    with torch.no_grad():
        for rank in range(args.world):  # each rank's rows, as the trainer's ranks compute them
            starts = torch.tensor(offsets[rank * rows:(rank + 1) * rows]).unsqueeze(1)
            window = corpus[(starts + torch.arange(args.seq_len + 1)).reshape(-1)].view(rows, -1).long()
            logits = model(window[:, :-1].contiguous())
            losses.append(F.cross_entropy(logits.flatten(0, 1).float(), window[:, 1:].contiguous().flatten()).item())
    loss = sum(losses) / args.world
    if loss != recorded[step]:
        sys.exit(f"MISMATCH loss of step {step}: the PyTorch replica's {loss!r}, the trainer's {recorded[step]!r} "
                 f"(ranks' losses {losses})")
    print(f"loss: the PyTorch replica's loss of step {step} equals the trainer's bit for bit ({loss!r}, "
          f"{args.world} ranks, {args.heads} heads / {model.layers[0].attention.kv_heads} KV heads, vocab {vocab})")


def loss_flags(argv):
    import argparse

    parser = argparse.ArgumentParser(prog="trainer_interop.py loss STEP_K_DIR RUN_JSON CORPUS")
    for flag in ("--world", "--seed", "--global-batch", "--seq-len", "--heads"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--kv-heads", type=int, default=0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    if len(sys.argv) >= 5 and sys.argv[1] == "loss":
        replica_loss(sys.argv[2], sys.argv[3], sys.argv[4], loss_flags(sys.argv[5:]))
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        compare(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 5 and sys.argv[1] == "rewrite":
        rewrite(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif len(sys.argv) == 4 and sys.argv[1] == "adamw":
        adamw(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
