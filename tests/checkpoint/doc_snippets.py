"""Runs every ```python block of README.md and docs/*.md with the venv's
torch, so that the Python the documentation shows is Python that works.

    python doc_snippets.py SOURCE_ROOT WORKDIR

The blocks run in WORKDIR, where checkpoint_python_test made what they
open: ROOT/step-100 (a save_training_state checkpoint whose "model" holds
the tensors of `small_model()` below, with "step" and the generator
"cpu_rng") and hf/ (an HF export of the same tensors, in several files).
The blocks of one file run in order in one namespace, as a reader would
run them one after the other. A block that needs objects the documentation
only describes names a setup on the line before its fence:

    <!-- python-setup: fsdp_model -->

    fsdp_model   a 1-rank gloo process group and `model`, small_model()
                 sharded with fully_shard (PyTorch's FSDP2)
    app_state    `model`, `optimizer`, `step` and `AppState`, the Stateful
                 of PyTorch's distributed-checkpoint recipe

Prints one line per block; exits non-zero at the first block that fails
(with its traceback), or when no block is found.
"""

import glob
import os
import re
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import interop  # noqa: E402  (the numpy-free object collectives)

FENCE = re.compile(r"^\s*```python\s*$")
SETUP = re.compile(r"^\s*<!--\s*python-setup:\s*(\S+)\s*-->\s*$")


def small_model():
    """The model whose state checkpoint_python_test saves as ROOT/step-100/model."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def setup_fsdp_model(ns, workdir):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(workdir, 'pg_init')}", rank=0,
                                world_size=1)
    model = small_model()
    fully_shard(model)
    ns["model"] = model


def setup_app_state(ns, workdir):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful

    class AppState(Stateful):
        """PyTorch's recipe (distributed checkpoint, "Saving"): the model and
        the optimizer as one Stateful."""

        def __init__(self, model, optimizer=None):
            self.model = model
            self.optimizer = optimizer

        def state_dict(self):
            model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
            return {"model": model_state_dict, "optim": optimizer_state_dict}

        def load_state_dict(self, state_dict):
            set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                           optim_state_dict=state_dict["optim"])

    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    ns.update(AppState=AppState, model=model, optimizer=optimizer, step=1)


SETUPS = {"fsdp_model": setup_fsdp_model, "app_state": setup_app_state}


def blocks_of(path):
    """[(line number, setup or None, code)] of the ```python blocks in `path`."""
    lines = open(path).read().split("\n")
    out = []
    i = 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            m = SETUP.match(lines[i - 1]) if i > 0 else None
            end = i + 1
            while end < len(lines) and not lines[end].strip().startswith("```"):
                end += 1
            out.append((i + 1, m.group(1) if m else None, "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        i += 1
    return out


def main(source_root, workdir):
    interop._object_collectives_without_numpy()
    sys.path.insert(0, os.path.join(source_root, "checkpoint", "python"))
    os.chdir(workdir)
    torch.set_num_threads(1)
    files = [os.path.join(source_root, "README.md")] + sorted(glob.glob(os.path.join(source_root, "docs", "*.md")))
    count = 0
    for path in files:
        name = os.path.relpath(path, source_root)
        ns = {"__name__": "__doc_snippet__"}
        for line, setup, code in blocks_of(path):
            where = f"{name}:{line}"
            if setup is not None and setup not in SETUPS:
                sys.exit(f"{where}: unknown python-setup '{setup}' (doc_snippets.py knows {sorted(SETUPS)})")
            try:
                if setup is not None:
                    SETUPS[setup](ns, workdir)
                exec(compile(code, where, "exec"), ns)
            except BaseException:
                traceback.print_exc()
                sys.exit(f"FAILED {where}" + (f" (setup {setup})" if setup else ""))
            print(f"ran {where}" + (f" (setup {setup})" if setup else ""))
            count += 1
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    if count == 0:
        sys.exit("no ```python block found: the extraction is broken")
    print(f"doc_snippets: {count} python blocks ran")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
