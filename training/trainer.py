"""The training loop: single device, nn.DataParallel, or DDP (one process per device)."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from . import data as data_mod
from .checkpoint import BackgroundWriter, CheckpointError, CheckpointStore, load_model_state
from .checkpoint import model_state, rng_state, save_file, set_rng_state, to_cpu, unwrap
from .config import TrainConfig, batch_split
from .distributed import DistContext, LaunchError, all_reduce_sum, broadcast_from_main, gather_to_main
from .distributed import load_on_every_rank
from .builder import make_model
from .errors import TrainingDiverged
from .faults import fault_hook
from .metrics import MetricsFile
from .contract import FAULT_ENV, LAUNCH_ATTEMPT_ENV, epoch_line, main_line, ranks
from .objective import Totals, apply, batch_len, concat, load_objective, split_batch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Trainer:
    """Builds model, data and optimizer from a config and trains from where it left off."""

    def __init__(self, cfg: TrainConfig, ctx: DistContext, bundle: data_mod.DataBundle,
                 metrics: MetricsFile | None = None):
        self.cfg, self.ctx, self.device = cfg, ctx, ctx.device
        bundle, self.data_on_device = data_mod.data_to_device(bundle, self.device, cfg.num_workers)
        self.bundle = bundle
        self.pin = self.device.type == "cuda" and not self.data_on_device
        model, self.model_spec = make_model(cfg.model, bundle.num_classes, bundle.input_shape, cfg.model_args,
                                            cfg.code_root)
        self.model = self._wrap(model)
        self.optimizer = self._make_optimizer()
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.precision == "fp16")
        self.objective = load_objective(cfg.objective, cfg.code_root)
        self.store = CheckpointStore(cfg.checkpoint_dir)
        if ctx.is_main:
            self.store.claim()
        self.metrics = metrics or MetricsFile(ctx.is_main)
        self.fault = fault_hook(os.environ.get(FAULT_ENV))
        self.epochs_run = 0
        self.history: list[dict] = []
        self.writer = BackgroundWriter(self.store)
        self.resumed_from: str | None = None
        self.train_time_s = 0.0
        self._resume()
        world = ctx.world_size  # the loaders after the resume: their workers' seeds depend on the epochs trained
        self.train_loader, self.sampler = data_mod.train_loader(bundle.train, cfg, ctx.rank, world, self.pin,
                                                                self.epochs_run)
        # DistributedSampler pads each rank's share at its end: only its first `real_train` samples count
        self.real_train = len(range(ctx.rank, len(bundle.train), world))
        self.val_loader = data_mod.val_loader(bundle.val, cfg, ctx.rank, world, self.pin)

    # --- construction -----------------------------------------------------------------
    def _wrap(self, model: nn.Module) -> nn.Module:
        if self.ctx.strategy == "ddp":
            return DDP(model.to(self.device), device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if self.ctx.strategy == "dp":
            return self._wrap_dp(model)
        return model.to(self.device)

    def _wrap_dp(self, model: nn.Module) -> nn.Module:
        if self.device.type != "cuda":
            return nn.DataParallel(model)  # on CPU it runs the module as is
        visible = torch.cuda.device_count()
        ids = self.cfg.device_ids or list(range(visible))
        bad = [i for i in ids if not 0 <= i < visible]
        if bad:
            raise LaunchError(
                f"DataParallel device_ids {ids} include {bad}, but this process sees logical "
                f"ids 0..{visible - 1} (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); logical ids always start at 0"
            )
        if why := batch_split(self.cfg.batch_size, len(ids), "DataParallel devices"):
            raise LaunchError(why)
        model = model.to(torch.device("cuda", ids[0]))  # must live on device_ids[0] first
        return nn.DataParallel(model, device_ids=ids)

    def _make_optimizer(self) -> torch.optim.Optimizer:
        params = self.model.parameters()
        if self.cfg.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.cfg.lr, momentum=self.cfg.momentum)
        return torch.optim.Adam(params, lr=self.cfg.lr)

    def _autocast(self):
        return torch.autocast(self.device.type, DTYPES[self.cfg.precision], enabled=self.cfg.precision != "fp32")

    # --- checkpoints --------------------------------------------------------------------
    def _resume(self) -> None:
        restarted = ranks().restarts > 0 or int(os.environ.get(LAUNCH_ATTEMPT_ENV, 1)) > 1  # torchrun's, Prefect's
        path = self.store.resume_path(self.cfg.resume, restarted) if self.ctx.is_main else None
        # rank 0's choice on every rank: only rank 0 writes checkpoints, another machine's folder has none
        path = broadcast_from_main(path and str(path), self.ctx)
        if path is None:
            return
        payload = load_on_every_rank(path, self.ctx)
        try:
            load_model_state(self.model, payload["model"], source=f"checkpoint {str(path)!r}")
            if (saved := payload["config"].get("optimizer", self.cfg.optimizer)) != self.cfg.optimizer:
                raise CheckpointError(f"checkpoint {str(path)!r} holds {saved} state, but this run's optimizer is "
                                      f"{self.cfg.optimizer}; resume with --optimizer {saved}, or start afresh "
                                      "(--resume never)")
            self.optimizer.load_state_dict(payload["optimizer"])
            for group in self.optimizer.param_groups:  # the checkpoint's moments; this run's lr, momentum (its params)
                group.update({k: self.optimizer.defaults[k] for k in ("lr", "momentum") if k in group})
            if payload["scaler"] and self.scaler.is_enabled():  # {} from a run without fp16: the scaler starts fresh
                self.scaler.load_state_dict(payload["scaler"])
            set_rng_state(payload["rng"])
        except KeyError as e:
            raise CheckpointError(f"checkpoint {str(path)!r} lacks {e}; it was not written by gpuflow") from None
        self.epochs_run = int(payload["epoch"])
        self.history = list(payload.get("history", []))
        self.resumed_from = str(path)
        self._say(main_line(f"resumed from {path} after epoch {self.epochs_run}"))

    def _end_epoch(self, metrics: dict) -> None:
        """Rank 0 writes the epoch's checkpoint while the next epoch trains, then logs the epoch: a logged epoch's
        file is whole before its line."""
        epoch = self.epochs_run
        if not self.ctx.is_main or not (self.cfg.checkpoint_each_epoch or epoch == self.cfg.epochs):
            return self._log_epoch(epoch, metrics)  # no write pending: none before the last, without each epoch's
        retain = (self.cfg.keep_checkpoints, list(self.history), f"val_{self.objective.monitor}", self.objective.mode)
        self.writer.submit(self._checkpoint_payload(), epoch, retain, lambda: self._log_epoch(epoch, metrics))

    def _log_epoch(self, epoch: int, metrics: dict) -> None:
        self.metrics.log_epoch(epoch, metrics)
        scores = " ".join(f"{k.replace('accuracy', 'acc')} {v:.4f}" for k, v in metrics.items() if k.startswith("val_"))
        self._say(epoch_line(epoch, self.cfg.epochs, f"train_loss {metrics['train_loss']:.4f} {scores} "
                             f"{metrics['samples_per_s']:.0f} samples/s"))

    def _checkpoint_payload(self) -> dict:
        """A copy of everything a resume needs, as CPU tensors: it loads on any host, and training goes on."""
        return {
            "model": model_state(self.model),
            "optimizer": to_cpu(self.optimizer.state_dict()),
            "scaler": self.scaler.state_dict(),
            "epoch": self.epochs_run,
            "rng": rng_state(),
            "config": self.cfg.to_dict(),
            "num_classes": self.bundle.num_classes,
            "input_shape": list(self.bundle.input_shape) if self.bundle.input_shape is not None else None,
            "model_spec": self.model_spec,  # reference and exact kwargs: the user's class rebuilds from it
            "history": list(self.history),
        }

    # --- loop ---------------------------------------------------------------------------
    def _to_device(self, batch, non_blocking: bool = False):
        return apply(batch, lambda t: t.to(self.device, non_blocking=non_blocking))

    def _run_batch(self, inputs, target, real: int) -> torch.Tensor:
        """One optimizer step; the loss summed over the batch's first `real` samples (no sampler padding)."""
        self.optimizer.zero_grad(set_to_none=True)
        with self._autocast():
            out = self.objective.forward(self.model, inputs, target)
            loss = self.objective.loss(out, target)
        self.scaler.scale(loss).backward()
        if self.cfg.grad_clip:
            self.scaler.unscale_(self.optimizer)  # clip true gradients, not scaled ones
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        n = batch_len(target if target is not None else inputs)
        if real == n:
            return loss.detach().double() * n
        if real <= 0:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        with torch.no_grad(), self._autocast():  # only a rank's last batch: its padded samples
            head = (lambda t: t[:real])
            if self.objective.pass_target_as:  # the model's own loss is the batch's: run the real samples again
                out = self.objective.forward(self.model, apply(inputs, head), apply(target, head))
            else:
                out = apply(out, head)
            return self.objective.loss(out, apply(target, head)).detach().double() * real

    def _batches(self, loader, desc: str):
        if self.ctx.is_main and sys.stderr.isatty():
            from tqdm import tqdm

            return tqdm(loader, desc=desc, leave=False, dynamic_ncols=True)
        return loader

    def _run_epoch(self, epoch: int) -> dict:
        self.model.train()
        self.sampler.set_epoch(epoch)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        start = time.perf_counter()
        for step, batch in enumerate(self._batches(self.train_loader, f"epoch {epoch + 1}"), 1):
            if self.fault:  # test-only: a fault lands after the last epoch's checkpoint is whole
                self.writer.wait()
                self.fault(self.ctx.rank, epoch + 1, step)
            inputs, target = split_batch(self._to_device(batch, self.pin))
            real = min(batch_len(target if target is not None else inputs), self.real_train - count)
            loss_sum += self._run_batch(inputs, target, real)  # no .item(): no sync per step
            count += real
            if self.cfg.max_steps_per_epoch and step >= self.cfg.max_steps_per_epoch:
                break
        total, n = all_reduce_sum([loss_sum.item(), count], self.ctx)
        elapsed = time.perf_counter() - start
        self._check_finite("train_loss", total / n, epoch + 1)
        return {"train_loss": total / n, "samples_per_s": n / elapsed, "epoch_time_s": elapsed}

    def _check_finite(self, name: str, value: float, epoch: int) -> None:
        """Once an epoch, on the all-reduced value: every rank stops together, nothing is saved."""
        if not math.isfinite(value):
            raise TrainingDiverged(f"{name} is {value} in epoch {epoch}; training diverged. Lower lr "
                                   f"(now {self.cfg.lr}), set grad_clip, or use fp32")

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Validation loss and the objective's metrics, each sample counted once whatever the world size."""
        model = unwrap(self.model) if self.ctx.distributed else self.model
        model.eval()
        totals = Totals(self.objective)
        for batch in self.val_loader:
            inputs, target = split_batch(self._to_device(batch))
            with self._autocast():
                totals.add(self.objective.forward(model, inputs, target), target,
                           batch_len(target if target is not None else inputs))
        names = list(totals.sums)
        reduced = all_reduce_sum([totals.sums[k].item() for k in names] + [totals.counts[k] for k in names], self.ctx)
        result = {f"val_{k}": reduced[i] / reduced[len(names) + i] for i, k in enumerate(names)}
        self._check_finite("val_loss", result["val_loss"], self.epochs_run + 1)
        if self.objective.epoch_metrics:
            result.update(self._whole_set_metrics(totals.outputs, totals.targets))
        return result

    def _whole_set_metrics(self, outputs: list, targets: list) -> dict:
        """epoch_metrics on every validation sample once, in dataset order (rank r held r, r + world, ...)."""
        # batches without a target: None, not a list of a None per batch (whose length differs between ranks)
        joined = concat(targets) if any(t is not None for t in targets) else None
        gathered = gather_to_main((concat(outputs), joined), self.ctx)
        metrics = {}
        if self.ctx.is_main:
            world = len(gathered)
            n = sum(batch_len(o) for o, _ in gathered)
            order = torch.tensor([i for r in range(world) for i in range(r, n, world)]).argsort()
            merged = [_in_order([g[j] for g in gathered], order) for j in (0, 1)]
            metrics = {f"val_{k}": float(v) for k, v in self.objective.epoch_metrics(*merged).items()}
        return broadcast_from_main(metrics, self.ctx)

    def train(self) -> dict:
        start = time.perf_counter()
        try:
            for epoch in range(self.epochs_run, self.cfg.epochs):
                metrics = self._run_epoch(epoch)
                metrics.update(self.evaluate())
                metrics["lr"] = self.optimizer.param_groups[0]["lr"]
                self.epochs_run = epoch + 1
                self.history.append({"epoch": self.epochs_run, **metrics})
                self._end_epoch(metrics)
        finally:  # also when an epoch fails or a stop arrives: the last file whole, its line logged
            self.writer.wait()
        self.train_time_s = time.perf_counter() - start
        return self.result()

    def result(self) -> dict:
        final = self.history[-1] if self.history else self.evaluate()
        return {
            "final_metrics": {k: v for k, v in final.items() if k != "epoch"},
            "checkpoint": self.writer.last or (str(latest) if (latest := self.store.latest()) else None),
            "epochs_run": self.epochs_run,
            "world_size": self.ctx.world_size,
            "strategy": self.ctx.strategy,
            "device": str(self.device),
            "data_on_device": self.data_on_device,
            "resumed_from": self.resumed_from,
            "restarts": ranks().restarts,
            "train_time_s": self.train_time_s,
            "peak_memory_mb": (torch.cuda.max_memory_allocated(self.device) / 2**20
                               if self.device.type == "cuda" else None),
            "history": self.history,
            "model_spec": self.model_spec,
            "objective": self.cfg.objective,
            "monitor": self.objective.monitor,
            "mode": self.objective.mode,
        }

    def save_weights(self, path: Path) -> Path:
        """Save the trained model's state dict alone (CPU, no wrapper prefix): what the registered model loads."""
        return save_file(path, model_state(self.model))

    def _say(self, line: str) -> None:
        if self.ctx.is_main:
            print(line, flush=True)


def _in_order(parts: list, order: torch.Tensor):
    """Each rank's part joined, in dataset order; None where no batch had a target."""
    return None if parts[0] is None else apply(concat(parts), lambda t: t[order])
