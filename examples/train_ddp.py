"""A torchrun script written the way the PyTorch DDP tutorial writes one (multigpu_torchrun.py):
`init_process_group`, `LOCAL_RANK`, `DistributedSampler`, a `snapshot.pt` it saves every
`--save-every` epochs and resumes from. No gpuflow import: run it alone or under gpuflow.

    torchrun --standalone --nproc-per-node=2 examples/train_ddp.py --epochs 5
    gpuflow run --script examples/train_ddp.py --gpus cpu -- --epochs 5 --lr 0.01

It runs on GPUs (nccl, one per process) or, where CUDA is absent, on the CPU (gloo). Its data is
random (2048 samples of 20 features, a linear target), so it needs no download. On rank 0 it
logs `train_loss` per epoch to MLflow when a run is given (MLFLOW_RUN_ID, as gpuflow gives it).
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

TRACKED = "MLFLOW_RUN_ID" in os.environ  # read once: MLflow's first call takes it out of the environment


def ddp_setup() -> torch.device:
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        init_process_group(backend="nccl")
        return torch.device("cuda", local_rank)
    init_process_group(backend="gloo")
    return torch.device("cpu")


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, device):
        self.rank = int(os.environ["RANK"])
        self.device = device
        self.model = model.to(device)
        self.train_data, self.optimizer = train_data, optimizer
        self.save_every, self.snapshot_path = save_every, snapshot_path
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)

    def _load_snapshot(self, path):
        snapshot = torch.load(path, map_location=self.device, weights_only=True)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_epoch(self, epoch) -> float:
        self.train_data.sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for source, targets in self.train_data:
            source, targets = source.to(self.device), targets.to(self.device)
            self.optimizer.zero_grad()
            loss = F.mse_loss(self.model(source), targets)
            loss.backward()
            self.optimizer.step()
            total, batches = total + loss.item(), batches + 1
        return total / batches

    def _save_snapshot(self, epoch):
        torch.save({"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1}, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            loss = self._run_epoch(epoch)
            if self.rank == 0:
                print(f"Epoch {epoch} | train_loss {loss:.4f}", flush=True)
                if TRACKED:
                    import mlflow

                    mlflow.log_metric("train_loss", loss, step=epoch + 1)
                if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                    self._save_snapshot(epoch)


def load_train_objs(lr):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 20, generator=generator)
    y = x @ torch.randn(20, 1, generator=generator) + 0.1 * torch.randn(2048, 1, generator=generator)
    model = torch.nn.Linear(20, 1)
    return TensorDataset(x, y), model, torch.optim.SGD(model.parameters(), lr=lr)


def main():
    parser = argparse.ArgumentParser(description="the PyTorch DDP tutorial's training script")
    parser.add_argument("--epochs", type=int, default=5, help="total epochs to train")
    parser.add_argument("--save-every", type=int, default=1, help="save a snapshot every N epochs")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size on each process")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--snapshot", default="snapshot.pt", help="the snapshot it saves and resumes from")
    args = parser.parse_args()
    device = ddp_setup()
    dataset, model, optimizer = load_train_objs(args.lr)
    data = DataLoader(dataset, batch_size=args.batch_size, shuffle=False, sampler=DistributedSampler(dataset))
    Trainer(model, data, optimizer, args.save_every, args.snapshot, device).train(args.epochs)
    torch.distributed.barrier()  # leave together: on gloo, a rank tearing down early can abort the other
    destroy_process_group()


if __name__ == "__main__":
    main()
