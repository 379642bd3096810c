#!/usr/bin/env python3
"""What an fsdp2cpp checkpoint holds, for Python users: every tensor's key,
dtype, global shape, and which files hold which of its rows; and the
state_dict skeleton that torch.distributed.checkpoint.load needs to read it.

    fsdp2cpp_checkpoint.py list DIR          # one line per tensor, one per piece
    fsdp2cpp_checkpoint.py list --json DIR   # the same as JSON

DIR is a directory of safetensors files (ROOT/step-N/model, a copy of
PyTorch's sharded files, an HF export) or a checkpoint ROOT/step-N, whose
subdirectories (model/, optim/, ...) are listed one after the other.

    import fsdp2cpp_checkpoint                      # this file, on sys.path
    sd = fsdp2cpp_checkpoint.state_dict_skeleton("ROOT/step-100/model")
    dcp.load(sd, storage_reader=HuggingFaceStorageReader("ROOT/step-100/model"), no_dist=True)

The files are read the way checkpoint/src/sharded.cc reads them: each
file's safetensors header (8 bytes of little-endian length, then JSON); a
piece's place in the global tensor from __metadata__["DCP_SHARDING_INFO"]
(PyTorch's HuggingFaceStorageWriter format: {key: {"saved_offsets": [...]}},
offsets 0 when absent); the global shape as the largest offset + shape over
the pieces; model.safetensors.index.json's weight_map, when present, saying
which file holds each key; tied aliases from __metadata__["FSDP2CPP_TIED"]
({alias: key}), which dcp.load does not know (load the key, then tie).
Only the standard library is needed, except torch for state_dict_skeleton.
"""

import json
import os
import struct
import sys

SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
TIED_KEY = "FSDP2CPP_TIED"
INDEX_FILE = "model.safetensors.index.json"
MANIFEST_FILE = "manifest.json"

# safetensors dtype names -> torch dtype attribute names.
TORCH_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "F16": "float16",
    "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32", "F64": "float64", "I64": "int64",
    "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


def read_header(path):
    """The (metadata, tensors) of one safetensors file: __metadata__ as a
    dict of strings, and {key: {"dtype", "shape", "data_offsets"}}."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: shorter than a safetensors header")
        (length,) = struct.unpack("<Q", raw)
        if length > 1 << 30:
            raise ValueError(f"{path}: a header of {length} bytes is not a safetensors header")
        header = json.loads(f.read(length))
    metadata = header.pop("__metadata__", None) or {}
    return metadata, header


def _files_of(directory):
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        return sorted(set(weight_map.values())), weight_map
    names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    return names, None


def list_tensors(directory):
    """{key: {"dtype": "F32", "shape": [global shape], "pieces": [{"file",
    "offsets", "shape"}], "tied_to": None}} for every tensor in `directory`
    (a directory of safetensors files), in the order the files list them; a
    tied alias has "tied_to" set to the key whose values it shares."""
    names, weight_map = _files_of(directory)
    if not names:
        raise ValueError(f"{directory} holds no *.safetensors file: not a directory of checkpoint files "
                         f"(for a checkpoint ROOT/step-N, use list_checkpoint)")
    tensors, aliases = {}, {}
    for name in names:
        metadata, header = read_header(os.path.join(directory, name))
        sharding = json.loads(metadata[SHARDING_INFO_KEY]) if SHARDING_INFO_KEY in metadata else {}
        if TIED_KEY in metadata:
            aliases.update(json.loads(metadata[TIED_KEY]))
        for key, entry in header.items():
            if weight_map is not None and weight_map.get(key, name) != name:
                continue
            shape = list(entry["shape"])
            offsets = list(sharding.get(key, {}).get("saved_offsets", [0] * len(shape)))
            info = tensors.setdefault(key, {"dtype": entry["dtype"], "shape": [0] * len(shape), "pieces": [],
                                            "tied_to": None})
            if info["dtype"] != entry["dtype"] or len(info["shape"]) != len(shape):
                raise ValueError(f"{key} is {entry['dtype']} {shape} in {name} but {info['dtype']} with "
                                 f"{len(info['shape'])} dims in {info['pieces'][0]['file']}")
            info["shape"] = [max(g, o + s) for g, o, s in zip(info["shape"], offsets, shape)]
            info["pieces"].append({"file": name, "offsets": offsets, "shape": shape})
    for alias, key in aliases.items():
        if key in tensors and alias not in tensors:
            tensors[alias] = dict(tensors[key], tied_to=key)
    return tensors


def list_checkpoint(path):
    """{"": list_tensors(path)} for a directory of safetensors files, else
    {subdirectory: list_tensors(...)} for each subdirectory of a checkpoint
    ROOT/step-N that holds safetensors files (model, optim, ...)."""
    if _files_of(path)[0]:
        return {"": list_tensors(path)}
    parts = {}
    for sub in sorted(os.listdir(path)):
        full = os.path.join(path, sub)
        if os.path.isdir(full) and _files_of(full)[0]:
            parts[sub] = list_tensors(full)
    if not parts:
        raise ValueError(f"{path} holds no *.safetensors file, nor subdirectories with some")
    return parts


def state_dict_skeleton(directory, keys=None):
    """{key: torch.empty(global shape, dtype)} for the tensors of `directory`
    (all, or those in `keys`; tied aliases left out), which
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(directory),
    no_dist=True) fills with the full tensors."""
    import torch

    out = {}
    for key, info in list_tensors(directory).items():
        if info["tied_to"] is not None or (keys is not None and key not in keys):
            continue
        out[key] = torch.empty(info["shape"], dtype=getattr(torch, TORCH_DTYPES[info["dtype"]]))
    missing = sorted(set(keys or []) - set(out))
    if missing:
        raise KeyError(f"{directory} does not hold {missing}")
    return out


def _where(piece, shape):
    if not shape:
        return "whole"
    whole_rows = all(o == 0 for o in piece["offsets"][1:]) and piece["shape"][1:] == shape[1:]
    if whole_rows:
        return f"rows [{piece['offsets'][0]}, {piece['offsets'][0] + piece['shape'][0]})"
    return f"offsets {piece['offsets']} shape {piece['shape']}"


def format_listing(parts):
    lines = []
    for sub, tensors in parts.items():
        if sub:
            lines.append(f"{sub}/")
        indent = "  " if sub else ""
        for key, info in tensors.items():
            lines.append(f"{indent}{key}  {info['dtype']}  {info['shape']}"
                         + (f"  tied to {info['tied_to']}" if info["tied_to"] else ""))
            if info["tied_to"]:
                continue
            for piece in info["pieces"]:
                lines.append(f"{indent}  {piece['file']}  {_where(piece, info['shape'])}")
    return "\n".join(lines)


def main(argv):
    args = argv[1:]
    as_json = "--json" in args
    args = [a for a in args if a != "--json"]
    if len(args) != 2 or args[0] != "list":
        sys.stderr.write(__doc__)
        return 2
    try:
        parts = list_checkpoint(args[1])
    except (OSError, ValueError, KeyError) as e:
        sys.stderr.write(f"fsdp2cpp_checkpoint: {e}\n")
        return 1
    print(json.dumps(parts, indent=1) if as_json else format_listing(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
