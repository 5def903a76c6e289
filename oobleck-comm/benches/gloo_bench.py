"""PyTorch Gloo (torch.distributed, CPU) numbers for the side-by-side comm benchmark.

Run by `cargo bench -p oobleck-comm --bench comm`; prints one JSON object per line from rank 0:
{"kind": "allreduce"|"p2p", "world": N, "bytes": B, "secs": seconds per op}.
Usage: python3 gloo_bench.py --world 2 --sizes 4096,65536 --p2p-sizes 1048576
"""
import argparse
import json
import os
import socket
import sys
import time


def iters_for(nbytes):
    return max(3, min(200, (512 << 20) // max(nbytes, 1)))


def worker(rank, world, port, sizes, p2p_sizes):
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=__import__("datetime").timedelta(seconds=120),
    )
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        dist.all_reduce(t)  # warm-up
        n = iters_for(nbytes)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(t)
        secs = (time.perf_counter() - start) / n
        if rank == 0:
            print(json.dumps({"kind": "allreduce", "world": world, "bytes": nbytes, "secs": secs}), flush=True)
    if world == 2:
        for nbytes in p2p_sizes:
            t = torch.ones(nbytes // 4, dtype=torch.float32)
            ack = torch.zeros(1)
            n = iters_for(nbytes)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(n):
                if rank == 0:
                    dist.send(t, 1)
                else:
                    dist.recv(t, 0)
            if rank == 0:
                dist.recv(ack, 1)
                secs = (time.perf_counter() - start) / n
                print(json.dumps({"kind": "p2p", "world": world, "bytes": nbytes, "secs": secs}), flush=True)
            else:
                dist.send(ack, 0)
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--sizes", required=True)
    p.add_argument("--p2p-sizes", default="")
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",") if s]
    p2p = [int(s) for s in a.p2p_sizes.split(",") if s]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(a.world, port, sizes, p2p), nprocs=a.world, join=True)


if __name__ == "__main__":
    sys.exit(main())
