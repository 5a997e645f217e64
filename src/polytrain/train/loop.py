"""The training loop every ``polytrain train`` process runs, whatever the strategy."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..checkpoint import CheckpointError, load, run_record, save
from ..checkpoint.manifest import write_atomically
from ..config import TrainConfig, check_init, model_profile
from ..data import EpochBatches, corpus_digest, training_data
from ..emulation.clock import clock_of, emulate
from ..emulation.devices import parse_cluster
from ..errors import ConfigError, first_line
from ..models import get_model, seq_len_of
from ..optim import make_optimizer
from ..runtime import Context, init
from ..strategies.base import distribute, get_strategy
from ..strategies.checks import check_same_value
from .metrics import build_metrics, steady_steps, write_metrics
from .progress import Progress

__all__ = ["train", "make_optimizer", "evaluate"]

log = logging.getLogger(__name__)


def lr_factor(step: int, *, steps: int, schedule: str, warmup: int) -> float:
    """The learning rate of step ``step`` (from 0) as a fraction of ``--lr``.

    A linear warm-up over the first ``warmup`` steps (step ``i`` at ``(i + 1) / warmup``),
    then ``constant`` 1, or ``cosine`` from 1 down to 0.1 at the last step.
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = steps - 1 - warmup
    done = (step - warmup) / span if span > 0 else 1.0
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, done)))


def make_scheduler(config: TrainConfig,
                   optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR | None:
    """The run's learning-rate schedule on ``optimizer`` (None: constant, no warm-up)."""
    if config.lr_schedule == "constant" and config.warmup_steps == 0:
        return None
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_factor, steps=config.steps, schedule=config.lr_schedule,
        warmup=config.warmup_steps))


def train(config: TrainConfig) -> dict[str, Any] | None:
    """Train as this process's part of the run; worker 0 returns (and writes) the metrics."""
    started = time.perf_counter()
    distributed = get_strategy(config.strategy).distributed
    ctx: Context | None = init(timeout_s=config.timeout_s, device=config.device) \
        if distributed else None  # a server serves inside init() and exits there
    device = ctx.device if ctx is not None else torch.device(config.device)
    cluster = parse_cluster(config.devices) if config.devices is not None else None
    if ctx is not None:
        ctx.cluster = cluster
    spec = get_model(config.model)
    torch.manual_seed(config.seed)
    model = spec.make(**config.model_options).to(device)
    if config.init is not None:  # every worker loads it; distribute() then agrees on worker 0's
        model.load_state_dict(check_init(config.init, model))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    seq_len = seq_len_of(model, config.model_options)
    optimizer = make_optimizer(config.optimizer, model, config.lr)
    if cluster is not None and device.type == "cpu":  # on real GPUs nothing is emulated
        # Every strategy, ddp included, runs at the speed of this worker's device.
        own = cluster.devices[ctx.worker_index if ctx is not None else 0]
        emulate(model, own.type, model_profile(spec, model, config.model_options))
    # The step API, as a user's script would use it: the trainer shards each global batch
    # with the replica the strategy has at that step, and adds MoE gates' losses.
    trainer = distribute(model, optimizer, config.strategy, ctx=ctx, loss_fn=spec.loss,
                         **dict(config.strategy_options))
    strategy = trainer.strategy
    scheduler = make_scheduler(config, trainer.optimizer)  # every strategy follows its lr
    lead = ctx is None or ctx.worker_index == 0
    tokens = spec.tokens(model, config.data)
    corpus = corpus_digest(tokens)
    if ctx is not None:  # another Python on another machine reads another corpus
        check_same_value(ctx, corpus, "corpus (the data set's token ids, by sha256)",
                         "run every machine on the same Python, with the same standard "
                         "library: the data sets are its files")
    batches, held = training_data(tokens, window=seq_len + 1,
                                  batch_size=config.batch_size, seed=config.seed,
                                  sampling=config.sampling,
                                  hold_out=config.eval_every is not None)
    held_out = spec.split(held) if held is not None else None
    if isinstance(batches, EpochBatches):
        strategy.epoch_steps = batches.steps_per_epoch
    evals: list[dict[str, float | None]] = []
    end_eval: int | None = None  # the step of an evaluation made only because the run ends
    save_errors: list[str] = []
    start, before_losses, before_times = 0, [], []  # the steps a resumed run did before
    # The steps that are not steady state (:func:`~.metrics.steady`): where this run and those
    # it resumed from started again, and where the strategy re-planned, moving state.
    cold: list[int] = []
    if config.resume is not None:
        resumed = load(config.resume, trainer, scheduler=scheduler)
        start = resumed.step  # load() set the trainer's step count
        before_losses = list(resumed.extra.get("losses", []))
        before_times = list(resumed.extra.get("times", []))
        cold = [*resumed.extra.get("cold_steps", []), len(before_times)]  # where ours start
        # Their held-out evaluations and save errors too (older checkpoints: none kept).
        evals = list(resumed.extra.get("evals", []))
        every = config.eval_every
        if (every is not None and resumed.extra.get("end_eval") == start and start % every
                and start < config.steps):
            # Made only because that run ended here: a longer run's schedule has none here
            # (a restart at the run's end trains no step, and keeps it: the run ends here).
            evals = [e for e in evals if e["step"] != start]
        save_errors = list(resumed.extra.get("save_errors", []))
        if lead:
            log.warning("resumed from %s at step %d", resumed.path, start)
    progress = Progress(config.steps, enabled=strategy.shows_progress and not config.quiet)
    # On an emulated network worker 0 reads the NICs at every step mark, and the metrics keep
    # the steady window's (after the warm-up, after the last step). At those two marks every
    # worker settles first: a peer still receiving its step's bytes there counted them in
    # the NIC's window but not in the meter's (BytePS: up to 2% more on a 15-step run).
    # (Marks count this run's steps; the window begins at its first steady step
    # (metrics.steady_steps): past the warm-up of all steps, and a resumed run's first is cold.)
    first_steady = next((i - len(before_times) for i in steady_steps(config.steps, cold)
                         if i >= len(before_times)), config.steps - start)
    settle = ({first_steady, config.steps - start}
              if ctx is not None and ctx.emulated_network else set())
    losses: list[float | None] = []
    times: list[float] = []
    with progress:  # an error ends the bar's line first
        for step, batch in zip(range(start, config.steps), batches.iterate(start)):
            inputs, targets = spec.split(batch)
            t0 = time.perf_counter()
            loss = trainer.step(inputs, targets)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            losses.append(loss)
            if trainer.replanned:  # Parallax's re-partition, PipeTransformer's new plan
                cold.append(len(before_times) + len(times) - 1)
            if scheduler is not None:
                scheduler.step()
            if ctx is not None:
                if step + 1 - start in settle or (settle and trainer.replanned):
                    # (a re-planned step, left out of the window, bounds it too)
                    dist.barrier(group=ctx.groups.workers)
                ctx.meter.mark_step()
            # PipeTransformer's bar follows pipeline 0's last stage, which a new plan moves.
            progress.show(strategy.shows_progress and not config.quiet)
            progress.update(step, loss, config.batch_size / max(times[-1], 1e-9),
                            replica=trainer.replica)  # its slice's loss: it says whose
            for line in strategy.notices():  # a new plan (PipeTransformer's freeze points)
                progress.note(line)
            aside = False  # bytes between steps that are not training's
            if held_out is not None and ((step + 1) % config.eval_every == 0  # type: ignore[operator]
                                         or step + 1 == config.steps):
                aside = True
                net = strategy.evaluation_model(trainer.model)
                if net is not None:
                    value, accuracy = evaluate(net, *held_out, spec.loss, device=device)
                    evals.append({"step": step + 1, "loss": value, "accuracy": accuracy,
                                  "train_time_s": sum(before_times) + sum(times)})
                    if (step + 1) % config.eval_every:  # type: ignore[operator]
                        end_eval = step + 1
            if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0:
                aside = True
                # The losses are summed once the save has finished the strategy's work in
                # flight, as at the end of the run (below).
                _checkpoint(config, trainer, scheduler, step + 1, run_record(config, corpus),
                            functools.partial(_records, ctx, before_losses, losses, {
                                "times": before_times + times, "cold_steps": cold,
                                "evals": evals, "end_eval": end_eval,
                                "save_errors": list(save_errors)}), save_errors)
            if aside and ctx is not None:  # Parallax's gathers of its tables, say: not a step's
                ctx.meter.discard()
    # The state first: it finishes what the strategy has in flight (a pipeline's last
    # backwards and pulls), which waits for the slowest replica in polytrain's own waits.
    # The losses' collective before it left a stage's sends to a peer stage sitting in that
    # collective: they timed out, and gloo's closed connections named an innocent process.
    state = trainer.state_dict()
    global_losses = before_losses + _global_losses(ctx, losses)
    times = before_times + times
    reports = _worker_reports(ctx)
    records = strategy.metrics()  # the strategy's own (worker 0's go to metrics.json)
    trainer.close()
    if ctx is not None:
        ctx.shutdown()
    if not lead:
        return None
    metrics = build_metrics(config=config, losses=global_losses, times=times,
                            model_bytes=model_bytes,
                            topology=ctx.topology if ctx is not None else None,
                            reports=reports, wall_s=time.perf_counter() - started,
                            cold=cold)
    metrics.update({k: v for k, v in records.items() if k not in metrics})
    if held_out is not None:
        metrics["eval"] = evals
        metrics["final_eval_loss"] = evals[-1]["loss"] if evals else None
    if config.init is not None:
        metrics["init"] = config.init
    if config.checkpoint_every or config.resume:
        metrics["checkpoints"] = {"every": config.checkpoint_every, "keep": config.keep,
                                  "resumed_from": config.resume, "resumed_at": start,
                                  "save_errors": save_errors}
    if config.out is not None:
        out = Path(config.out)
        try:
            out.mkdir(parents=True, exist_ok=True)
            write_atomically(out / "final.pt", lambda tmp: torch.save(state, tmp))
            write_metrics(out, metrics)
        except (OSError, RuntimeError) as e:  # torch.save reports a full disk as RuntimeError
            # Bad input, not a failure to restart from: a restart would train again to here.
            raise ConfigError(f"cannot write the results to --out {out} ({first_line(e)})",
                              "free space there, or pass another --out; the run's "
                              "checkpoints, if any, hold it up to the last") from None
    return metrics


@torch.no_grad()
def evaluate(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
             loss_fn: Any, *, device: torch.device, chunk: int = 64
             ) -> tuple[float, float | None]:
    """Mean loss and next-token accuracy of ``model`` on held-out samples, at real speed
    (an emulated device's clock pauses: evaluation is not training time). The accuracy is
    None for a model whose output is not a score per class (wordlm gives its losses)."""
    clock = clock_of(model)
    total, correct, count, scores = 0.0, 0.0, 0, True
    was_training = model.training
    model.eval()
    try:
        with clock.paused() if clock is not None else contextlib.nullcontext():
            for i in range(0, inputs.shape[0], chunk):
                x, y = inputs[i:i + chunk].to(device), targets[i:i + chunk].to(device)
                out = model(x)
                total += float(loss_fn(out, y)) * x.shape[0]
                scores = out.shape[:-1] == y.shape
                if scores:
                    correct += float((out.argmax(-1) == y).float().mean()) * x.shape[0]
                count += x.shape[0]
    finally:
        model.train(was_training)
    return total / count, correct / count if scores else None


def _checkpoint(config: TrainConfig, trainer: Any, scheduler: Any, step: int,
                run: dict[str, Any], extra: Callable[[], dict[str, Any]],
                errors: list[str]) -> None:
    """Write ``out/checkpoints/step-S`` (every worker; ``run``: :func:`run_record`'s;
    ``extra``: the run's records so far, what a resumed run's metrics.json carries on
    from, made once the save has finished the strategy's work in flight); a failure stops
    the run or is recorded in ``errors``, per ``--on-save-error``."""
    assert config.out is not None
    try:
        save(Path(config.out) / "checkpoints", trainer, step=step, scheduler=scheduler,
             extra=extra, run=run, keep=config.keep)
    except CheckpointError as e:
        if config.on_save_error == "stop":
            raise
        errors.append(e.what)
        log.warning("%s; training on (--on-save-error continue)", e.what)


def _records(ctx: Context | None, before: list[float], losses: list[float | None],
             others: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's records: ``others`` and the losses so far (``before``: a resumed run's,
    already global; then this run's, summed over the workers)."""
    return {"losses": before + _global_losses(ctx, losses), **others}


def _global_losses(ctx: Context | None, losses: list[float | None]) -> list[float]:
    """The mean over replicas of each step's loss (ranks that hold no loss contribute nothing)."""
    values = torch.tensor([0.0 if x is None else x for x in losses], dtype=torch.float64)
    counts = torch.tensor([0.0 if x is None else 1.0 for x in losses], dtype=torch.float64)
    if ctx is not None and ctx.num_workers > 1:
        both = torch.stack([values, counts])
        dist.all_reduce(both, group=ctx.groups.workers)
        values, counts = both[0], both[1]
    return (values / counts.clamp(min=1)).tolist()


def _worker_reports(ctx: Context | None) -> list[Any]:
    if ctx is None:
        return []
    reports: list[Any] = [None] * ctx.num_workers
    dist.all_gather_object(reports, ctx.meter.report(), group=ctx.groups.workers)
    return reports
