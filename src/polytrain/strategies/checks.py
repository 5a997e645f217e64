"""Start-up agreement among workers: the same model everywhere, the same initial weights."""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..comm.topology import Topology
from ..errors import CommTimeout, ConfigError, is_timeout
from ..ps.grads import sparse_parameter
from ..runtime import Context

__all__ = ["check_even_machines", "check_dense_gradients", "check_no_batch_scaled_gradients",
           "check_optimizer_of", "check_same_model", "check_same_optimizer", "check_same_tensors",
           "check_same_trained", "check_same_value", "check_same_values", "check_worker_models",
           "broadcast_module", "first_copy", "model_signature", "optimizer_signature",
           "tensor_signature"]


Signature = list[tuple[str, tuple[int, ...], str]]


def check_even_machines(strategy: str, topology: Topology,
                        why: str = "lays out its stages by machine") -> None:
    """Refuse machines with unlike numbers of workers for a strategy that lays itself out by
    machine (``why``; ``polytrain launch`` and ``train`` only start even ones; torchrun may
    not)."""
    counts = {m: len(topology.workers_on(m)) for m in topology.worker_machines}
    if len(set(counts.values())) > 1:
        raise ConfigError(f"strategy {strategy!r} {why} and needs as "
                          f"many workers on each, but this run has "
                          + ", ".join(f"{n} on {m}" for m, n in counts.items()),
                          "start as many workers on every machine (torchrun: the same "
                          "--nproc-per-node on every node)")


def tensor_signature(named: Iterable[tuple[str, torch.Tensor]]) -> Signature:
    """(name, shape, dtype) of every tensor, in order."""
    return [(n, tuple(t.shape), str(t.dtype)) for n, t in named]


def model_signature(model: nn.Module) -> Signature:
    """(name, shape, dtype) of every parameter and buffer, in registration order."""
    return tensor_signature([*model.named_parameters(), *model.named_buffers()])


def _first_difference(ref: list[Any], other: list[Any], ref_name: str, name: str) -> str:
    """The first tensor in which ``other`` (``name``'s) differs from ``ref`` (``ref_name``'s)."""
    in_ref = {n: (s, d) for n, s, d in ref}
    in_other = {n: (s, d) for n, s, d in other}
    for n, s, d in ref:
        if n not in in_other:
            return f"{name} lacks {n!r} {list(s)}, which {ref_name} has"
        if in_other[n] != (s, d):
            s2, d2 = in_other[n]
            return f"{n!r} is {list(s)} {d} on {ref_name} but {list(s2)} {d2} on {name}"
    for n, s, _ in other:
        if n not in in_ref:
            return f"{name} has {n!r} {list(s)}, which {ref_name} lacks"
    return f"{name} declares the same tensors in another order"


def check_same_model(ctx: Context, model: nn.Module) -> None:
    """Raise ConfigError on every worker if any worker built a different model."""
    check_same_tensors(ctx, model_signature(model), "model",
                       "build the same model with the same options on every worker")


def check_same_trained(ctx: Context, model: nn.Module) -> None:
    """Raise ConfigError on every worker if the workers froze other parameters (the same
    tensors, another set that trains): their gradient sums would not match (a mismatch on
    some workers, a timeout or a silently wrong sum on the others)."""
    check_same_tensors(ctx, tensor_signature(
        (n, p) for n, p in model.named_parameters() if p.requires_grad),
        "trained parameters (requires_grad)",
        "freeze the same parameters on every worker before wrapping the model")


def check_worker_models(ctx: Context, model: nn.Module) -> None:
    """What every way in (:func:`~polytrain.distribute`, the drop-in DDP) checks of the
    workers' models: that every worker built the same model and froze the same parameters,
    then, on more than one worker, no embedding that only one process can train."""
    check_same_model(ctx, model)
    check_same_trained(ctx, model)
    if ctx.num_workers > 1:
        check_no_forward_renorm(model)
        check_no_batch_scaled_gradients(model)


def _plain(value: Any) -> Any:
    # A setting as a plain, comparable value (a one-element tensor lr is its number).
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else tuple(value.flatten().tolist())
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    text = repr(value)  # an object's default repr holds its address, other in every process
    return type(value).__qualname__ if " at 0x" in text else text


def _state_said(state: Mapping[str, Any] | None) -> str:
    # A parameter's optimizer state, cheaply (no tensor's contents): any, and at which step.
    if not state:
        return "no state"
    step = _plain(state.get("step"))
    return f"state at step {step:g}" if isinstance(step, (int, float)) else "state"


def optimizer_signature(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Any]:
    """The optimizer's class, then each parameter group's settings, parameter names and
    the parameters' state in words (whether they have any, at which step)."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        settings = {k: _plain(v) for k, v in sorted(group.items()) if k != "params"}
        groups.append((settings, [names.get(id(p), "(not in the model)")
                                  for p in group["params"]],
                       [_state_said(optimizer.state.get(p)) for p in group["params"]]))
    return [type(optimizer).__qualname__, groups]


def _optimizer_difference(a: list[Any], b: list[Any]) -> tuple[str, str]:
    """How optimizer signature ``b`` differs from ``a``, and what to do."""
    same = "build the same optimizer with the same settings on every worker"
    if a[0] != b[0]:
        return f"is {b[0]}, not {a[0]}", same
    if len(a[1]) != len(b[1]):
        return f"has {len(b[1])} parameter groups, not {len(a[1])}", same
    for i, ((sa, pa, ta), (sb, pb, tb)) in enumerate(zip(a[1], b[1])):
        for key in sorted(set(sa) | set(sb)):
            if sa.get(key) != sb.get(key):
                return (f"sets {key} {sb.get(key)!r} in parameter group {i}, not "
                        f"{sa.get(key)!r}", same)
        if pa != pb:
            return f"holds other parameters in parameter group {i}", same
        for name, x, y in zip(pa, ta, tb):
            if x != y:
                return (f"holds {y} for {name!r} in parameter group {i}, not {x}",
                        "load the same optimizer state on every worker before distribute() "
                        "(optimizer.load_state_dict on each), or on none")
    return "differs", same


def check_optimizer_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that updates parameters the model does not hold: a strategy
    synchronises the model's parameters only (and one that shards them keeps only those)."""
    ours = {id(p) for p in model.parameters()}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    stray = sum(1 for p in held if id(p) not in ours)
    if stray:
        raise ConfigError(f"{stray} of the optimizer's {len(held)} parameters are not the "
                          f"model's: no strategy would synchronise them, and the workers' "
                          f"copies would drift apart (or, none being the model's, nothing "
                          f"would train)", "build the optimizer over model.parameters() of "
                          "the model given to distribute()")


def check_same_optimizer(ctx: Context, model: nn.Module,
                         optimizer: torch.optim.Optimizer) -> None:
    """Raise ConfigError on every worker if any worker's optimizer differs from worker 0's
    (class, parameter groups, their settings, which parameters have state and at which
    step): each would update its copy another way."""
    everyone: list[Any] = [None] * ctx.num_workers
    dist.all_gather_object(everyone, optimizer_signature(model, optimizer),
                           group=ctx.groups.workers)
    ref_rank = ctx.topology.workers[0]
    for i, other in enumerate(everyone):
        if other != everyone[0]:
            rank = ctx.topology.workers[i]
            how, fix = _optimizer_difference(everyone[0], other)
            raise ConfigError(f"worker rank {rank}'s optimizer differs from worker rank "
                              f"{ref_rank}'s: it {how}", fix)


def check_same_tensors(ctx: Context, signature: Signature,
                       what: str, fix: str, root: int = 0) -> None:
    """Raise ConfigError on every worker if any worker's ``signature`` ((name, shape, dtype)
    of each tensor, in order) differs from worker index ``root``'s; ``what`` names the
    tensors in the message ("model"), ``fix`` is the hint."""
    everyone: list[Any] = [None] * ctx.num_workers
    dist.all_gather_object(everyone, signature, group=ctx.groups.workers)
    reference = everyone[root]
    ref_rank = ctx.topology.workers[root]
    for i, other in enumerate(everyone):
        if other != reference:
            rank = ctx.topology.workers[i]
            raise ConfigError(
                f"worker rank {rank}'s {what} differs from worker rank {ref_rank}'s: "
                + _first_difference(reference, other, f"worker rank {ref_rank}",
                                    f"worker rank {rank}"), fix)


def check_same_value(ctx: Context, value: Any, what: str, fix: str) -> None:
    """Raise ConfigError on every worker if any worker's ``value`` differs from worker 0's,
    naming the first that differs, its machine and both values."""
    check_same_values(ctx, {what: value}, fix)


def check_same_values(ctx: Context, values: Mapping[str, Any], fix: str) -> None:
    """:func:`check_same_value` for several values in one gather: ``values`` maps what each
    is (its name in the message) to this worker's value; the first that differs is named."""
    everyone: list[Any] = [None] * ctx.num_workers
    dist.all_gather_object(everyone, dict(values), group=ctx.groups.workers)
    for i, other in enumerate(everyone):
        for what, value in everyone[0].items():
            if other.get(what) != value:
                rank, first = ctx.topology.workers[i], ctx.topology.workers[0]
                raise ConfigError(f"worker rank {rank}'s {what} differs from worker rank "
                                  f"{first}'s (machine {ctx.topology.machine(rank)}: "
                                  f"{other.get(what)}; machine {ctx.topology.machine(first)}: "
                                  f"{value})", fix)


@torch.no_grad()
def broadcast_module(ctx: Context, model: nn.Module, *, buffers: bool = True) -> None:
    """Copy worker 0's parameters, and its buffers unless not ``buffers``, to every worker.
    A copy that outlasts the timeout (a slow link: gloo's tree takes several copies' time to
    the last worker) is a :class:`~polytrain.errors.CommTimeout` naming the tensor."""
    src = ctx.topology.workers[0]
    for name, t in [*model.named_parameters(), *(model.named_buffers() if buffers else ())]:
        with first_copy(ctx, f"worker 0's copy of {name} "
                             f"({t.numel() * t.element_size():,} bytes)"):
            dist.broadcast(t.data, src=src, group=ctx.groups.workers)


@contextlib.contextmanager
def first_copy(ctx: Context, what: str) -> Iterator[None]:
    """Turn a timeout of the start's copy of worker 0's model (``what``: which part, and its
    bytes) into a :class:`~polytrain.errors.CommTimeout` naming it: on a slow link the last
    worker waits several copies' time (gloo's tree), and gloo's own error named none."""
    try:
        yield
    except RuntimeError as e:
        if not is_timeout(e):
            raise
        raise CommTimeout(
            f"rank {ctx.rank} (machine {ctx.machine}): {what} to every worker at the start "
            f"did not arrive within --timeout {ctx.timeout_s:g} s (gloo passes it down a "
            f"tree of the workers: the last waits for several copies over the links)",
            "on a slow link (--bandwidth), raise --timeout (POLYTRAIN_TIMEOUT) or the "
            "bandwidth; otherwise look at the other workers' logs" if ctx.emulated_network
            else "if the other workers are alive but slow, raise --timeout "
                 "(POLYTRAIN_TIMEOUT); otherwise look at their logs",
            waited_s=ctx.timeout_s) from None


def check_dense_gradients(model: nn.Module, strategy: str) -> None:
    """Refuse a model with sparse gradients for a strategy whose engine sums dense ones (its
    first backward would fail in every worker)."""
    name = sparse_parameter(model)
    if name is not None:
        raise ConfigError(f"parameter {name!r} has sparse gradients (an "
                          f"nn.Embedding(sparse=True)), and strategy {strategy!r} sums dense "
                          f"ones", "train with --strategy parallax (its rows on servers) or "
                          "ddp, or make them dense (--model wordlm: --dense-grads)")


def check_no_batch_scaled_gradients(model: nn.Module) -> None:
    """Refuse an embedding that scales its gradient by the batch's counts of each row
    (``scale_grad_by_freq``): each worker would scale by its own slice's counts, and the
    sum would not be the one-process gradient (nor can a sparse gradient carry it)."""
    for name, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.scale_grad_by_freq:
            raise ConfigError(
                f"{name or type(m).__name__} scales its gradient by how often each row occurs "
                f"in the batch (scale_grad_by_freq=True): each worker would count its own "
                f"slice, and the summed gradient would not be the whole batch's",
                "leave scale_grad_by_freq out, or train with strategy single")


def check_no_forward_renorm(model: nn.Module) -> None:
    """Refuse an embedding that renormalizes the rows it reads during the forward
    (``max_norm``): each worker would change only its own batch's rows of its copy, unseen
    by the others and by the gradients, and the copies would drift apart."""
    for name, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None:
            raise ConfigError(
                f"{name or type(m).__name__} renormalizes the rows it reads in place during "
                f"the forward (max_norm={m.max_norm:g}): each worker would change only its "
                f"own batch's rows, unseen by the others, and the workers' copies would drift "
                f"apart", "leave max_norm out and clip the rows' norms after the optimizer "
                "step (the same on every worker), or train with strategy single")
