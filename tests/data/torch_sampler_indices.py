"""Prints PyTorch's DistributedSampler indices, the reference for
distributed_sampler_test.cc.

Reads configurations from stdin, one a line:
    dataset_size num_replicas rank shuffle seed epoch drop_last
(shuffle and drop_last are 0 or 1) and prints for each one line: the
configuration, ':', then list(iter(sampler)) after set_epoch(epoch), space
separated (nothing after ':' for an empty list).
"""
import sys
import warnings

warnings.filterwarnings("ignore")  # a missing NumPy warns on import

from torch.utils.data import DistributedSampler  # noqa: E402


def main():
    out = []
    for line in sys.stdin:
        fields = line.split()
        if not fields:
            continue
        size, replicas, rank, shuffle, seed, epoch, drop_last = (int(f) for f in fields)
        sampler = DistributedSampler(range(size), num_replicas=replicas, rank=rank, shuffle=bool(shuffle),
                                     seed=seed, drop_last=bool(drop_last))
        sampler.set_epoch(epoch)
        indices = list(iter(sampler))
        assert len(indices) == len(sampler)
        out.append(" ".join(fields) + ":" + "".join(f" {i}" for i in indices))
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
