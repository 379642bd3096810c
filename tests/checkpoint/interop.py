"""The Python side of checkpoint_python_test: PyTorch and safetensors read
what fsdp2cpp writes, and PyTorch writes what fsdp2cpp reads.

Values come from `formula`, computed here independently of the C++ side
(checkpoint_test_util.h has the same formula and the same SPECS table).

    python interop.py read_sharded DIR    # PyTorch's HuggingFaceStorageReader loads DIR
    python interop.py read_sharded_distributed DIR  # the same into DTensors at 2 gloo ranks, as
                                          # docs/checkpoints.md shows it (no numpy needed)
    python interop.py write_sharded DIR   # 3 gloo ranks save DTensors with HuggingFaceStorageWriter
    python interop.py read_hf DIR         # safetensors.torch.load_file reads an HF export
    python interop.py verify_manifest DIR # sizes and zlib.crc32 of a checkpoint's manifest
    python interop.py read_training_state DIR  # dcp.load reads model/ and optim/ of a
                                          # save_training_state checkpoint; its values and generator
    python interop.py read_with_skeleton DIR  # dcp.load into fsdp2cpp_checkpoint.py's
                                          # state_dict_skeleton(DIR)

Exits non-zero with a message on any mismatch.
"""

import io
import json
import math
import os
import sys
import tempfile
import zlib

import torch

# key, shape, dtype, seed, is a DTensor (else a plain tensor)
SPECS = [
    ("embed.weight", [10, 3], torch.float32, 1, True),
    ("layers.0.bias", [7], torch.bfloat16, 2, True),
    ("layers.0.idx", [2, 5], torch.int64, 3, True),
    ("layers.1.weight", [9, 2, 2], torch.float16, 4, True),
    ("norm.weight", [5], torch.float32, 5, False),
    ("scale", [], torch.float64, 6, False),
    ("empty", [0, 4], torch.float32, 7, True),
]


def formula(shape, dtype, seed):
    n = math.prod(shape)
    base = torch.arange(n, dtype=torch.int64)
    if dtype == torch.bool:
        out = ((base + seed) % 3) == 0
    else:
        v = (base * 7 + 13 * seed) % 251 - 125
        out = (v.double() * 0.25).to(dtype) if dtype.is_floating_point else v.to(dtype)
    return out.reshape(shape)


def check(name, got, expected):
    if got.dtype != expected.dtype or list(got.shape) != list(expected.shape) or not torch.equal(got, expected):
        sys.exit(f"MISMATCH {name}: got {got.dtype} {list(got.shape)} {got}\nexpected {expected.dtype} "
                 f"{list(expected.shape)} {expected}")


def read_sharded(path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    sd = {key: torch.zeros(shape, dtype=dtype) for key, shape, dtype, _, _ in SPECS}
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(path), no_dist=True)
    for key, shape, dtype, seed, _ in SPECS:
        check(key, sd[key], formula(shape, dtype, seed))
    print(f"read_sharded: {len(sd)} tensors equal the formula")


def read_with_skeleton(path):
    """dcp.load into checkpoint/python/fsdp2cpp_checkpoint.py's skeleton."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "checkpoint", "python"))
    import fsdp2cpp_checkpoint

    sd = fsdp2cpp_checkpoint.state_dict_skeleton(path)
    if sorted(sd) != sorted(key for key, *_ in SPECS):
        sys.exit(f"MISMATCH keys {sorted(sd)}")
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(path), no_dist=True)
    for key, shape, dtype, seed, _ in SPECS:
        check(key, sd[key], formula(shape, dtype, seed))
    print(f"read_with_skeleton: {len(sd)} tensors of the listed shapes and dtypes equal the formula")


def _read_rank(rank, world, init_file, path):
    # docs/checkpoints.md, "Opening our checkpoints from Python": no numpy
    # workaround here, since the documented call must work without numpy.
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    sd = {}
    for key, shape, dtype, _, is_dtensor in SPECS:
        zeros = torch.zeros(shape, dtype=dtype)
        sd[key] = distribute_tensor(zeros, mesh, [Shard(0)]) if is_dtensor else zeros
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(path), no_dist=True)
    for key, shape, dtype, seed, is_dtensor in SPECS:
        check(key, sd[key].full_tensor() if is_dtensor else sd[key], formula(shape, dtype, seed))
    dist.barrier()
    dist.destroy_process_group()
    leave_rank()


def leave_rank():
    """Ends a spawned rank whose work is done. About one run in six on 2
    cores, a rank of torch 2.11 aborted after destroy_process_group, in its
    C++ teardown ("terminate called without an active exception", no Python
    frame left), so the rank exits without the interpreter's teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(rank_fn, world, path):
    """Runs rank_fn(rank, world, init_file, path) on `world` processes, one
    thread each, rendezvousing through a file in a fresh directory."""
    import torch.multiprocessing as mp

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_fn, args=(world, os.path.join(tmp, "init"), path), nprocs=world, join=True)


def read_sharded_distributed(path, world=2):
    _spawn(_read_rank, world, path)
    print(f"read_sharded_distributed: {len(SPECS)} tensors equal the formula on {world} ranks")


def _object_collectives_without_numpy():
    """torch's object collectives (which DCP's planning uses) turn the
    received bytes back into an object through numpy; the venv has no numpy,
    so do that step with torch alone."""
    import torch.distributed.distributed_c10d as c10d

    # torch 2.15 passes a fourth argument, weights_only (torch.load's
    # restricted unpickler instead of pickle's); 2.11 passes three.
    def tensor_to_object(tensor, tensor_size, group, weights_only=False):
        buf = bytes(tensor.cpu()[:tensor_size].tolist())
        if weights_only:
            return torch.load(io.BytesIO(buf), weights_only=True)
        return c10d._unpickler(io.BytesIO(buf)).load()

    c10d._tensor_to_object = tensor_to_object

    # safetensors.torch.save hands the Rust serializer each tensor's address
    # through a numpy array; hand it the address directly (little-endian host,
    # so no byte swap is involved). The bytes are still laid out by safetensors.
    import types

    import safetensors.torch as st

    def to_ndarray(tensor):
        tensor = tensor.cpu()
        buf = types.SimpleNamespace(ctypes=types.SimpleNamespace(data=tensor.data_ptr()),
                                    nbytes=tensor.numel() * tensor.element_size())
        return buf, tensor

    st._to_ndarray = to_ndarray


def _write_rank(rank, world, init_file, path):
    _object_collectives_without_numpy()
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    sd = {}
    for key, shape, dtype, seed, is_dtensor in SPECS:
        full = formula(shape, dtype, seed)
        sd[key] = distribute_tensor(full, mesh, [Shard(0)]) if is_dtensor else full
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(path, save_distributed=True))
    dist.barrier()
    dist.destroy_process_group()
    leave_rank()


def write_sharded(path, world=3):
    _spawn(_write_rank, world, path)
    print(f"write_sharded: {sorted(os.listdir(path))}")


def read_hf(path):
    from safetensors.torch import load_file

    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    loaded = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors = load_file(os.path.join(path, file))
        for key, value in tensors.items():
            if index["weight_map"].get(key) != file:
                sys.exit(f"MISMATCH: {key} is in {file} but the index says {index['weight_map'].get(key)}")
            loaded[key] = value
    total = 0
    for key, shape, dtype, seed, _ in SPECS:
        if key not in loaded:
            sys.exit(f"MISSING {key} in the export")
        check(key, loaded[key], formula(shape, dtype, seed))
        total += loaded[key].numel() * loaded[key].element_size()
    if index["metadata"]["total_size"] != total:
        sys.exit(f"MISMATCH total_size {index['metadata']['total_size']} != {total}")
    print(f"read_hf: {len(loaded)} tensors equal the formula, total_size {total}")


def verify_manifest(path):
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    for entry in manifest["files"]:
        with open(os.path.join(path, entry["path"]), "rb") as f:
            data = f.read()
        if len(data) != entry["size"] or f"{zlib.crc32(data) & 0xffffffff:08x}" != entry["crc32"]:
            sys.exit(f"MISMATCH {entry['path']}: size {len(data)} crc32 {zlib.crc32(data) & 0xffffffff:08x} vs {entry}")
    print(f"verify_manifest: {len(manifest['files'])} files match")


def read_training_state(path):
    """checkpoint_python_test's save_training_state checkpoint, as a PyTorch
    user would read it: dcp.load for the tensors, json for the manifest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    model = {key: torch.zeros(shape, dtype=dtype) for key, shape, dtype, _, _ in SPECS}
    dcp.load(model, storage_reader=HuggingFaceStorageReader(os.path.join(path, "model")), no_dist=True)
    for key, shape, dtype, seed, _ in SPECS:
        check(key, model[key], formula(shape, dtype, seed))
    optim = {}
    for key, shape, dtype, _, _ in SPECS:
        optim[f"state.{key}.exp_avg"] = torch.zeros(shape, dtype=dtype)
        optim[f"state.{key}.step"] = torch.zeros((), dtype=torch.float32)
    dcp.load(optim, storage_reader=HuggingFaceStorageReader(os.path.join(path, "optim")), no_dist=True)
    for key, shape, dtype, seed, _ in SPECS:
        check(f"state.{key}.exp_avg", optim[f"state.{key}.exp_avg"], formula(shape, dtype, seed + 100))
        check(f"state.{key}.step", optim[f"state.{key}.step"], torch.tensor(5.0))

    with open(os.path.join(path, "manifest.json")) as f:
        extra = json.load(f)["extra"]
    if extra["step"] != 5:
        sys.exit(f"MISMATCH step {extra['step']}")
    if extra["param_groups"] != [{"lr": 0.01, "params": ["embed.weight"]}]:
        sys.exit(f"MISMATCH param_groups {extra['param_groups']}")
    kinds = {name: item["kind"] for name, item in extra["training_state"]["items"].items()}
    if kinds != {"model": "stateful", "optim": "stateful", "step": "int64", "cpu_rng": "rng"}:
        sys.exit(f"MISMATCH items {kinds}")
    torch.set_rng_state(torch.tensor(list(bytes.fromhex(extra["cpu_rng"])), dtype=torch.uint8))
    got = torch.randn(4)
    torch.manual_seed(31)
    torch.randn(2)
    check("cpu_rng", got, torch.randn(4))
    print(f"read_training_state: model {len(model)} and optim {len(optim)} tensors, step 5, param_groups and the "
          "generator as saved")


if __name__ == "__main__":
    commands = {"read_sharded": read_sharded, "read_sharded_distributed": read_sharded_distributed,
                "write_sharded": write_sharded, "read_hf": read_hf, "verify_manifest": verify_manifest,
                "read_training_state": read_training_state, "read_with_skeleton": read_with_skeleton}
    if len(sys.argv) != 3 or sys.argv[1] not in commands:
        sys.exit(__doc__)
    commands[sys.argv[1]](sys.argv[2])
