"""The Python side of FsdpTrainCheckpoint.PyTorchReadsAndWritesTrainerCheckpoints:
PyTorch's own readers open fsdp_train's checkpoints, and a checkpoint PyTorch
writes with the trainer's FQNs starts a trainer run.

    python trainer_interop.py compare SHARDED_MODEL_DIR HF_DIR
        safetensors.torch.load_file reads the --export-hf files, PyTorch's
        HuggingFaceStorageReader (dcp.load, no_dist) reads the sharded
        checkpoint's model/ folder, and every tensor agrees bit for bit.
    python trainer_interop.py rewrite HF_DIR OUT_DIR WORLD
        WORLD gloo ranks load the export, shard every tensor with DTensor
        Shard(0) and save it with HuggingFaceStorageWriter(save_distributed=True).

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


def rewrite(hf_dir, out_dir, world):
    import torch.multiprocessing as mp

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rewrite_rank, args=(world, os.path.join(tmp, "init"), hf_dir, out_dir), nprocs=world, join=True)
    print(f"rewrite: {sorted(os.listdir(out_dir))}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "compare":
        compare(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 5 and sys.argv[1] == "rewrite":
        rewrite(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit(__doc__)
