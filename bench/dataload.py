"""Data loading: can the loader keep up with training? Samples/s of iterating one epoch
(shuffled, batch 64) through gpuflow's in-memory batch-gather path vs the seeds' style
TensorDataset + per-sample collate, with num_workers 0 and 2, next to the training rate."""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from bench.common import summary
from gpuflow.training import TrainConfig
from gpuflow.training.data import load_data, train_loader


def rate(loader, n: int) -> float:
    start = time.perf_counter()
    for _ in loader:
        pass
    return n / (time.perf_counter() - start)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    out = {}
    for dataset in ("digits", "synthetic"):
        for workers in (0, 2):
            cfg = TrainConfig(dataset=dataset, synthetic_size=16384, num_workers=workers)
            b = load_data(cfg)
            ours, _ = train_loader(b.train, cfg, 0, 1, pin=False)
            ds = TensorDataset(b.train.x, b.train.y)
            seeds = DataLoader(ds, batch_size=64, num_workers=workers,
                               sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True))
            n = len(b.train)
            rate(ours, n), rate(seeds, n)  # warm up workers
            out[f"{dataset}/{workers}"] = {
                "ours": summary([rate(ours, n) for _ in range(a.repeats)]),
                "seeds": summary([rate(seeds, n) for _ in range(a.repeats)]),
            }
    return {"args": vars(a), "results": out}


def table(res: dict) -> str:
    rows = ["| dataset | num_workers | gpuflow batch-gather samples/s | TensorDataset+collate samples/s | ratio |",
            "|---|---|---|---|---|"]
    for key, r in res["results"].items():
        ds, w = key.split("/")
        o, s = r["ours"]["median"], r["seeds"]["median"]
        rows.append(f"| {ds} | {w} | {o:,.0f} | {s:,.0f} | {o / s:.1f}x |")
    return "\n".join(rows)


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(table(main()))
