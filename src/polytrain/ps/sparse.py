"""The sparse row store: rows of a sparse parameter held on a server and updated there.

Parallax (Kim et al., EuroSys 2019) keeps each sparse variable on parameter
servers, cut into row ranges; workers push the rows their step touched
(indices and values) and pull only the rows they read. A key of this kind
(``Kind.SPARSE``) is one row range ``(rows, width)``; its declaration names
the update rule (:func:`polytrain.optim.sparse_rule`: sgd, adagrad, adam) and
the server applies it itself, once per round, to the rows that round touched.

- PUSH of round t: :func:`pack_rows` (the round's learning rate, whether the
  pusher's machine read the parameter at all that round, the round's settings
  of the rule (:func:`rule_settings`: a scheduler may move Adam's betas), the
  unique rows of this range the pusher touched, counted from the range's
  start, and their gradient, already averaged over the workers). A pusher
  that touched no row of the range pushes only the first three. Once all
  ``pushers`` have pushed round t and round t - 1 is applied, the pushes are
  concatenated in rank order, summed per row and the rule steps those rows,
  with the round's learning rate and settings. Its step count counts the
  rounds in which some machine read the parameter, as one process's
  optimizer counts the steps that gave the parameter a gradient.
- PULL of round r with a payload of int64 rows: their values, (rows, width),
  once r rounds are applied. Without a payload: the whole state
  (:func:`state_numel` elements: the values, the rule's state tensors, the
  rounds applied and the rule's steps, as :func:`~polytrain.ps.stores.pack_counts`
  carries them), which SET takes back, so a range can move
  to another key (re-partitioning) with its optimizer state and its round.
- GET: the whole state at once.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from ..errors import CommError
from ..optim import RULE_STATES, apply_rule
from .protocol import Kind, Op, Request
from .stores import (
    Declaration,
    Respond,
    Store,
    applied_waiting,
    check_full_precision,
    pack_counts,
    register_store,
    unpack_counts,
)

__all__ = ["SparseRowStore", "pack_rows", "unpack_rows", "rule_settings", "with_settings",
           "state_numel", "state_tensors", "STATE_NAMES"]

#: Each rule's state tensors, in the store's order, by the names torch's optimizers give them
#: in ``optimizer.state[param]`` (Adagrad's, Adam's and SparseAdam's; LazyAdam's alike).
STATE_NAMES = {"sgd": (), "adagrad": ("sum",), "adam": ("exp_avg", "exp_avg_sq")}

# Two float64 ahead of the rule's settings: the learning rate, whether it was read.
_HEAD_BYTES = 16


def rule_settings(rule: Mapping[str, Any]) -> list[float]:
    """The settings of ``rule`` (as :func:`polytrain.optim.sparse_rule` gives it) that every
    push carries after its learning rate: a scheduler may move them between steps
    (OneCycleLR cycles Adam's beta1). Adam: beta1, beta2, eps; Adagrad: lr_decay, eps."""
    if rule["name"] == "adam":
        return [float(rule["betas"][0]), float(rule["betas"][1]), float(rule["eps"])]
    if rule["name"] == "adagrad":
        return [float(rule["lr_decay"]), float(rule["eps"])]
    return []


def with_settings(rule: Mapping[str, Any], settings: Sequence[float]) -> dict[str, Any]:
    """``rule`` with the settings :func:`rule_settings` gave (in its order)."""
    if rule["name"] == "adam":
        beta1, beta2, eps = settings
        return {**rule, "betas": [beta1, beta2], "eps": eps}
    if rule["name"] == "adagrad":
        lr_decay, eps = settings
        return {**rule, "lr_decay": lr_decay, "eps": eps}
    return dict(rule)


def pack_rows(lr: float, rows: torch.Tensor, values: torch.Tensor, *,
              read: bool | None = None, settings: Sequence[float] = ()) -> torch.Tensor:
    """One push's payload as uint8: lr, ``read`` (default: whether ``rows`` holds any) and
    the rule's ``settings`` (:func:`rule_settings`; float64), rows (int64), values
    (rows, width)."""
    read = bool(rows.numel()) if read is None else read
    parts = [torch.tensor([lr, float(read), *settings], dtype=torch.float64).view(torch.uint8),
             rows.to(torch.int64).contiguous().view(torch.uint8),
             values.contiguous().view(-1).view(torch.uint8)]
    return torch.cat(parts)


def unpack_rows(payload: torch.Tensor, width: int, dtype: torch.dtype, settings: int = 0
                ) -> tuple[float, bool, tuple[float, ...], torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_rows` (of ``settings`` settings): lr, read, the settings,
    rows, values."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    head = _HEAD_BYTES + 8 * settings
    n, rest = divmod(payload.numel() - head, 8 + width * itemsize)
    if rest or n < 0:
        raise ValueError(f"a payload of {payload.numel()} bytes is not lr, read, {settings} "
                         f"settings + rows of width {width}")
    lr, read, *settings_of = payload[:head].view(torch.float64).tolist()
    rows = payload[head:head + 8 * n].view(torch.int64)
    values = payload[head + 8 * n:].view(dtype).view(n, width)
    return lr, bool(read), tuple(settings_of), rows, values


def state_tensors(rule: str) -> int:
    """The tensors of a range's whole state, each of the range's shape: values, then the
    rule's state."""
    return 1 + RULE_STATES[rule]


def state_numel(numel: int, rule: str) -> int:
    """Elements of a range's whole state: :func:`state_tensors`, then the rounds applied
    and the rule's steps (:func:`~polytrain.ps.stores.pack_counts`)."""
    return state_tensors(rule) * numel + 2


class SparseRowStore(Store):
    """Rows ``(numel / width, width)`` of a sparse parameter, updated by ``options["rule"]``."""

    def __init__(self, decl: Declaration, respond: Respond) -> None:
        super().__init__(decl, respond)
        check_full_precision(decl, "a sparse row store")
        self.width = int(decl.options["width"])
        self.rule: dict[str, Any] = dict(decl.options["rule"])
        if self.rule.get("name") not in RULE_STATES:
            raise CommError(f"server: {decl.describe()}: unknown sparse rule {self.rule!r}")
        if decl.numel % self.width:
            raise CommError(f"server: {decl.describe()}: {decl.numel} elements are not rows "
                            f"of {self.width}")
        rows = decl.numel // self.width
        dtype = decl.torch_dtype
        self.value = torch.zeros(rows, self.width, dtype=dtype)
        fill = float(self.rule.get("initial_accumulator_value", 0.0))
        self.state = [torch.full((rows, self.width), fill, dtype=dtype)
                      for _ in range(RULE_STATES[self.rule["name"]])]
        self.applied = 0
        self.steps = 0  # the rounds in which some machine read the parameter
        self.rounds: dict[int, dict[tuple[int, int], torch.Tensor]] = {}
        self.waiting: list[Request] = []

    def handle(self, req: Request) -> None:
        if req.op == Op.PUSH:
            if req.round <= self.applied:
                raise self.fail(req, f"round {req.round} is already applied")
            pushes = self.rounds.setdefault(req.round, {})
            if req.pusher in pushes:
                raise self.fail(req, "this rank already pushed this round")
            assert req.payload is not None
            pushes[req.pusher] = req.payload
            if len(pushes) > self.decl.pushers:
                raise self.fail(req, f"more pushers than the {self.decl.pushers} declared")
            self._apply_ready()
        elif req.op == Op.PULL:
            if self.applied >= req.round:
                self._answer(req)
            else:
                self.waiting.append(req)
        elif req.op == Op.GET:
            self._answer(req)
        elif req.op == Op.SET:
            assert req.payload is not None
            self._load(req.payload)
            self._apply_ready()  # pushes that came before a re-partitioned range's state
        else:
            raise self.fail(req, "a sparse row store answers PUSH, PULL, GET and SET only")

    def waiting_for(self, round: int) -> str:
        return applied_waiting(self.applied, dict(self.rounds), self.decl.pushers)

    def _apply_ready(self) -> None:
        stepped = False
        while len(self.rounds.get(self.applied + 1, ())) == self.decl.pushers:
            pushes = self.rounds.pop(self.applied + 1)
            count = len(rule_settings(self.rule))
            unpacked = [unpack_rows(pushes[p], self.width, self.value.dtype, count)
                        for p in sorted(pushes)]  # rank order: independent of arrival order
            heads = {(lr, settings) for lr, _, settings, _, _ in unpacked}
            if len(heads) != 1:
                raise CommError(f"server: {self.decl.describe()}: the pushers of round "
                                f"{self.applied + 1} disagree on the learning rate or the "
                                f"rule's settings ({sorted(heads)})",
                                "every worker must use the same optimizer settings and "
                                "schedule")
            lr, settings = heads.pop()
            # A round that read the parameter nowhere is not one of its steps: one process's
            # optimizer skips a parameter without a gradient (Adam's bias correction counts).
            self.steps += any(read for _, read, _, _, _ in unpacked)
            rows = torch.cat([r for _, _, _, r, _ in unpacked])
            if rows.numel():
                values = torch.cat([v for _, _, _, _, v in unpacked])
                unique, inverse = torch.unique(rows, return_inverse=True)
                summed = torch.zeros(unique.numel(), self.width, dtype=values.dtype)
                summed.index_add_(0, inverse, values)
                # The round's settings: a scheduler may have moved them since the declaration.
                apply_rule(with_settings(self.rule, settings), self.value, self.state, unique,
                           summed, step=self.steps, lr=lr)
            self.applied += 1
            stepped = True
        if stepped:
            ready = [r for r in self.waiting if self.applied >= r.round]
            self.waiting = [r for r in self.waiting if self.applied < r.round]
            for r in ready:
                self._answer(r)

    def _answer(self, req: Request) -> None:
        if req.op == Op.PULL and req.payload is not None:
            rows = req.payload
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.value.shape[0]):
                raise self.fail(req, f"rows outside 0 .. {self.value.shape[0] - 1}")
            self.respond(req, self.value[rows])
            return
        counts = pack_counts([self.applied, self.steps], self.value.dtype)
        self.respond(req, torch.cat([t.reshape(-1) for t in (self.value, *self.state)]
                                    + [counts]))

    def _load(self, payload: torch.Tensor) -> None:
        n = self.value.numel()
        if payload.numel() != state_numel(n, self.rule["name"]):
            raise CommError(f"server: {self.decl.describe()}: SET of {payload.numel()} "
                            f"elements, not the whole state's "
                            f"{state_numel(n, self.rule['name'])}")
        for i, t in enumerate((self.value, *self.state)):
            t.copy_(payload[i * n:(i + 1) * n].view_as(t))
        self.applied, self.steps = unpack_counts(payload[-2:])


register_store(Kind.SPARSE, SparseRowStore, "sparse row")
