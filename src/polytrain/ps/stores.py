"""What a server keeps for one key: the store kinds, their state machines and their registry.

A store is a state machine over requests (:class:`~polytrain.ps.protocol.Request`):
``handle`` takes one and answers it through ``respond`` now or later. Stores
run on a server's engine thread and never wait, so they can be driven
directly in a unit test (a list as ``respond``). New kinds join with
:func:`register_store`; every kind a server knows is in :data:`STORES`.
"""

from __future__ import annotations

import functools
import inspect
import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ClassVar, Sequence

import torch

from ..errors import CommError, ConfigError
from ..tensors import sum_dtype
from .protocol import Kind, Op, Request
from .settings import setting_values

__all__ = ["Declaration", "Store", "SumStore", "ParamStore", "OptimizerStore", "STORES",
           "WHOLE_STATE", "optimizer_state_numel", "register_store", "store_name",
           "applied_waiting", "pushes_of", "pusher_name", "pack_counts", "unpack_counts"]

#: The round of a GET that asks a store for its whole state (see OptimizerStore, and the
#: compressed sum store: ps/compressed.py).
WHOLE_STATE = -1

Respond = Callable[[Request, torch.Tensor], None]

# The signed integers whose bits carry a count in an element of each width (bytes).
_COUNT_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def pack_counts(counts: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Whole numbers (rounds applied, a rule's steps) as elements of ``dtype`` at the end of
    an answer or a whole state: each the bits of a signed integer as wide, so that they
    arrive exact (as float32 values, 16,777,217 rounds came back as 16,777,216)."""
    bits = _COUNT_BITS[dtype.itemsize]
    top = torch.iinfo(bits).max
    if any(not 0 <= c <= top for c in counts):
        raise CommError(f"counts {list(counts)} do not fit a {dtype} key's count (0 .. {top})",
                        "keep the key in float64 to count further")
    return torch.tensor(list(counts), dtype=bits).view(dtype)


def unpack_counts(tail: torch.Tensor) -> list[int]:
    """The counts :func:`pack_counts` put in ``tail``."""
    return [int(c) for c in tail.view(_COUNT_BITS[tail.element_size()]).tolist()]


@dataclass(frozen=True)
class Declaration:
    """A key as a worker declares it; every worker's declaration of a key must agree."""

    key: int
    kind: int
    name: str
    numel: int
    dtype: str
    pushers: int
    pullers: int
    options: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype.removeprefix("torch."))
        assert isinstance(dtype, torch.dtype)
        return dtype

    def describe(self) -> str:
        dtype = self.dtype.removeprefix("torch.")
        return (f"key {self.key} = {self.name!r}, {self.numel} x {dtype}"
                f", {store_name(self.kind)} store, {self.pushers} pushers")

    def mismatch(self, other: Declaration) -> str | None:
        """What differs between two declarations of the same key, or None. (Sizes before
        names: a partition's name carries its tensor's size, ``'grad.w[0] of 10'``.)"""
        for name in ("kind", "numel", "dtype", "name", "pushers", "pullers", "options"):
            if getattr(self, name) != getattr(other, name):
                return name
        return None


class Store(ABC):
    """One key's state on a server. ``handle`` runs on the key's engine thread only."""

    #: The one narrower dtype a payload may have, by the key's: asynchronous BytePS pushes
    #: float16 updates (``--compress fp16``) to a float32 parameter store.
    narrower: ClassVar[dict[torch.dtype, torch.dtype]] = {}

    def __init__(self, decl: Declaration, respond: Respond) -> None:
        self.decl = decl
        self.respond = respond

    @abstractmethod
    def handle(self, req: Request) -> None:
        """Apply a request; answer it with ``self.respond`` now or once it can be answered.

        An answer's tensor must not change afterwards (the server sends it while the
        store goes on): answer a copy of state that later requests update."""

    def waiting_for(self, round: int) -> str:
        """Why an answer of ``round`` waits, for a server's report of answers held long
        (read from another thread than the store's: a glimpse, not a consistent state)."""
        return ""

    def fail(self, req: Request, what: str, hint: str | None = None) -> CommError:
        return CommError(f"server: {self.decl.describe()}: request {req.op.name} of round "
                         f"{req.round} from {pusher_name(req.pusher)}: {what}", hint)

    def payload(self, req: Request) -> torch.Tensor:
        """``req``'s payload (an empty tensor's request carries none), refused unless of the
        key's dtype or the one :attr:`narrower` allows: another was summed as it came (an
        int64 push to a float32 key), or overflowed (float64's 1e6 made a float16 key inf)."""
        declared = self.decl.torch_dtype
        if req.payload is None:
            return torch.empty(0, dtype=declared)
        if req.payload.dtype not in (declared, self.narrower.get(declared)):
            raise self.fail(req, f"it pushed {req.payload.dtype} values, and the key is "
                                 f"declared {declared}",
                            "push the key's dtype (convert the tensor with .to()), or declare "
                            "the key with the tensor's dtype")
        return req.payload

    def declared_payload(self, req: Request) -> torch.Tensor:
        """``req``'s :meth:`payload`, refused unless of the declared size too (one of another
        size was broadcast into the sum, or failed in torch naming no key)."""
        payload = self.payload(req)
        if payload.numel() != self.decl.numel:
            raise self.fail(req, f"it pushed {payload.numel()} elements, and the key is "
                                 f"declared {self.decl.numel} x {self.decl.torch_dtype}")
        return payload


def _rank_sum(pushes: dict[tuple[int, int], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The pushes summed in the pushers' order (rank, then lane): results independent of
    arrival order."""
    ranks = sorted(pushes)
    acc = pushes[ranks[0]].to(dtype, copy=True)
    for r in ranks[1:]:
        acc.add_(pushes[r])
    return acc


def pusher_name(pusher: tuple[int, int]) -> str:
    """``rank 3``, or ``rank 3 lane 1`` for a process that pushes in more than one lane."""
    rank, lane = pusher
    return f"rank {rank}" + (f" lane {lane}" if lane else "")


def pushes_of(pushes: dict[tuple[int, int], Any] | None, pushers: int) -> str:
    """``n of its N pushes (from rank 0, rank 3 lane 1)``: a round's pushes so far."""
    who = sorted(pushes or ())
    names = ", ".join(pusher_name(p) for p in who)
    return f"{len(who)} of its {pushers} pushes" + (f" (from {names})" if who else "")


def applied_waiting(applied: int, rounds: dict[int, dict[tuple[int, int], Any]],
                    pushers: int) -> str:
    """Why a store that applies its rounds in order has not reached a round yet."""
    return (f"{applied} rounds applied; round {applied + 1} has "
            f"{pushes_of(rounds.get(applied + 1), pushers)}")


def _release(waiting: list[Request], ready: Callable[[Request], bool],
             answer: Callable[[Request], None]) -> list[Request]:
    """Answer the waiting pulls that are ready now; return the others, in order."""
    for r in [r for r in waiting if ready(r)]:
        answer(r)
    return [r for r in waiting if not ready(r)]


class _Round:
    __slots__ = ("pushes", "pushers", "result", "waiting", "served")

    def __init__(self) -> None:
        self.pushes: dict[tuple[int, int], torch.Tensor] = {}
        self.pushers: set[tuple[int, int]] = set()  # who pushed: kept once pushes are summed
        self.result: torch.Tensor | None = None
        self.waiting: list[Request] = []
        self.served = 0


class SumStore(Store):
    """Synchronous summation: round r's result is the sum of the ``pushers`` pushes of round r.

    Pushes are summed in the order of the pushers' ranks once all have
    arrived, so results do not depend on arrival order; pulls that arrive
    early wait. A round is freed once its ``pullers`` pulls are answered.
    """

    def __init__(self, decl: Declaration, respond: Respond) -> None:
        super().__init__(decl, respond)
        self.rounds: dict[int, _Round] = {}
        dtype = decl.torch_dtype
        self.acc_dtype = sum_dtype(dtype)

    def handle(self, req: Request) -> None:
        rnd = self.rounds.setdefault(req.round, _Round())
        if req.op in (Op.PUSH, Op.PUSHPULL):
            if req.pusher in rnd.pushers:
                raise self.fail(req, "this rank already pushed this round")
            if len(rnd.pushers) == self.decl.pushers:
                pushed = pushes_of(dict.fromkeys(rnd.pushers), self.decl.pushers)
                raise self.fail(req, f"more pushers than the {self.decl.pushers} declared: "
                                     f"round {req.round} had {pushed}")
            rnd.pushes[req.pusher] = self.declared_payload(req)
            rnd.pushers.add(req.pusher)
            if len(rnd.pushes) == self.decl.pushers:
                rnd.result = self._sum(rnd.pushes)
                rnd.pushes.clear()
                waiting, rnd.waiting = rnd.waiting, []
                for r in waiting:
                    self._serve(r, rnd)
        if req.op in (Op.PULL, Op.PUSHPULL):
            if rnd.result is None:
                rnd.waiting.append(req)
            else:
                self._serve(req, rnd)
        elif req.op != Op.PUSH:
            raise self.fail(req, "a sum store answers PUSH, PULL and PUSHPULL only")

    def waiting_for(self, round: int) -> str:
        rnd = self.rounds.get(round)
        pushes = None if rnd is None else dict(rnd.pushes)
        return f"round {round} has {pushes_of(pushes, self.decl.pushers)}"

    def _sum(self, pushes: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor:
        return _rank_sum(pushes, self.acc_dtype).to(self.decl.torch_dtype)

    def _serve(self, req: Request, rnd: _Round) -> None:
        assert rnd.result is not None
        self.respond(req, rnd.result)
        rnd.served += 1
        if rnd.served == self.decl.pullers:
            del self.rounds[req.round]


class ParamStore(Store):
    """Parameters held on the server, updated by pushes, read with bounded staleness.

    - SET replaces the value and restarts the rounds: every pusher's next push
      is its round 1 again. A worker initialises the value after declaring, and
      sets it again when a checkpoint is loaded mid-run, with no push or pull
      in flight (a load is collective); the workers count their rounds from
      there (asynchronous BytePS's ``base``).
    - PUSH adds the payload (an update: new minus old weights, already scaled
      by the worker) and advances the pusher's clock by one: its round must
      be the pusher's new clock (its pushes counted from 1).
    - PULL of round c answers once every one of the ``pushers`` has clock >=
      c - staleness (``options["staleness"]``, default 0); earlier pulls wait.
      The answer holds every push of rounds up to c that has arrived and none
      of a later round, so with staleness 0 a pull of round c is a barrier on
      all pushers' c-th push and answers exactly the value after round c, even
      when a worker that pulled first has already pushed round c + 1.
      GET answers every push so far at once.

    A round ahead of the slowest pusher is one running sum (a copy: no push
    is kept, so a server holds at most staleness + 2 values of a key, and no
    receive buffer stays pinned), added to the value once the slowest pusher
    has made the round. Clocks count pushes per key, so no coordination across
    servers is needed: this is the clocked parameter service of asynchronous
    BytePS (bounded staleness) and of HetPipe's Wave Synchronous Parallel (a
    clock is a wave).
    """

    narrower: ClassVar[dict[torch.dtype, torch.dtype]] = {torch.float32: torch.float16}

    def __init__(self, decl: Declaration, respond: Respond) -> None:
        super().__init__(decl, respond)
        self.value = torch.zeros(decl.numel, dtype=decl.torch_dtype)  # rounds <= global clock
        self.staleness = int(decl.options.get("staleness", 0))
        self.clocks: dict[tuple[int, int], int] = {}
        self.ahead: dict[int, torch.Tensor] = {}  # later rounds' pushes, summed per round
        self.waiting: list[Request] = []

    @property
    def global_clock(self) -> int:
        """The slowest pusher's clock (0 until every pusher has pushed)."""
        if len(self.clocks) < self.decl.pushers:
            return 0
        return min(self.clocks.values())

    def handle(self, req: Request) -> None:
        if req.op == Op.SET:
            self.value.copy_(self.declared_payload(req))
            self.ahead.clear()
            self.clocks.clear()
        elif req.op == Op.PUSH:
            payload = self.declared_payload(req)
            if req.pusher not in self.clocks and len(self.clocks) == self.decl.pushers:
                raise self.fail(req, f"more pushers than the {self.decl.pushers} declared")
            clock = self.clocks.get(req.pusher, 0) + 1
            if req.round != clock:  # a pull's answer is cut by round: they must agree
                raise self.fail(req, f"it is this pusher's push number {clock}: a parameter "
                                     f"store's rounds count each pusher's pushes from 1")
            self.clocks[req.pusher] = clock
            if clock in self.ahead:
                self.ahead[clock].add_(payload)
            else:
                self.ahead[clock] = payload.to(self.value.dtype, copy=True)
            slowest = self.global_clock
            for done in sorted(r for r in self.ahead if r <= slowest):
                self.value.add_(self.ahead.pop(done))
            self.waiting = _release(self.waiting, self._ready,
                                    lambda r: self.respond(r, self._read(r.round)))
        elif req.op == Op.PULL:
            if self._ready(req):
                self.respond(req, self._read(req.round))
            else:
                self.waiting.append(req)
        elif req.op == Op.GET:
            self.respond(req, self._read(None))
        else:
            raise self.fail(req, "a parameter store answers SET, PUSH, PULL and GET only")

    def _ready(self, req: Request) -> bool:
        return self.global_clock >= req.round - self.staleness

    def _read(self, round: int | None) -> torch.Tensor:
        """The value with the pushes of rounds up to ``round`` (None: every round) so far."""
        value = self.value.clone()
        for r in sorted(self.ahead):
            if round is None or r <= round:
                value.add_(self.ahead[r])
        return value

    def waiting_for(self, round: int) -> str:
        clocks = ", ".join(f"{pusher_name(p)} at {c}"
                           for p, c in sorted(dict(self.clocks).items()))
        return (f"it needs every one of its {self.decl.pushers} pushers at clock "
                f"{round - self.staleness} or more; pushers' clocks: {clocks or 'none yet'}")


def _build_optimizer(spec: dict[str, Any], param: torch.Tensor) -> torch.optim.Optimizer:
    settings: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                                for k, v in spec["settings"].items()}
    settings.pop("initial_lr", None)  # set by a scheduler, not an argument
    kind: type[torch.optim.Optimizer] = getattr(torch.optim, spec["class"])
    # A group holds settings its class fixes (AdamW: decoupled_weight_decay), which its
    # constructor does not take; any other unknown setting is an error.
    accepted = inspect.signature(kind.__init__).parameters
    for name in list(settings):
        if name not in accepted and name in _class_defaults(spec["class"]):
            del settings[name]
    # As the user's: the fused kernel (less overhead for a server's many small keys) is
    # other arithmetic (Adam: 3e-8 off in 5 steps), taken only where the user chose it.
    return kind([param], **settings)


@functools.lru_cache(maxsize=None)
def _class_defaults(name: str) -> frozenset[str]:
    """The settings ``torch.optim``'s class ``name`` puts in every group (once per class)."""
    kind: Any = getattr(torch.optim, name)
    try:
        return frozenset(kind([torch.zeros(1, requires_grad=True)]).defaults)
    except (TypeError, ValueError, RuntimeError):
        return frozenset()


@functools.lru_cache(maxsize=None)
def _state_layout(spec_json: str) -> tuple[tuple[str, bool, torch.dtype], ...]:
    """The tensor entries of a parameter's state under the optimizer of ``spec_json``, by
    name: (name, one value per element or a scalar, the scalar's dtype). Found by one step
    of the optimizer on a probe (state is made at the first step)."""
    probe = torch.zeros(2, requires_grad=True)
    optimizer = _build_optimizer(json.loads(spec_json), probe)
    probe.grad = torch.zeros(2)
    optimizer.step()
    state = optimizer.state.get(probe, {})
    return tuple((name, value.shape == probe.shape, value.dtype)
                 for name, value in sorted(state.items()) if isinstance(value, torch.Tensor))


def state_layout(spec: dict[str, Any]) -> tuple[tuple[str, bool, torch.dtype], ...]:
    return _state_layout(json.dumps(spec, sort_keys=True))


def optimizer_state_numel(spec: dict[str, Any], numel: int) -> int:
    """How many elements an optimizer store of ``numel`` parameters under ``spec`` answers to a
    whole-state GET: the value, each state tensor (``numel`` or 1 element), the rounds applied
    (:func:`pack_counts`)."""
    return numel + sum(numel if per else 1 for _, per, _ in state_layout(spec)) + 1


def check_full_precision(decl: Declaration, store: str) -> None:
    """Refuse a 16-bit key on a store whose whole state (a checkpoint's, a repartition's)
    carries its rounds applied in one element of the key's dtype (:func:`pack_counts`): 16
    bits count only to 32,767 (as values, bfloat16 held whole numbers only up to 256)."""
    if decl.torch_dtype not in (torch.float32, torch.float64):
        raise CommError(f"server: {decl.describe()}: {store} holds float32 or float64 "
                        f"values, not {decl.torch_dtype}",
                        "keep 16-bit parameters' master copy in float32")


class OptimizerStore(Store):
    """Parameters that an optimizer on the server updates, one step per round.

    - SET replaces the value (a worker initialises it once after declaring).
    - PUSH of round t (counted from 1) adds the payload, a gradient already
      scaled by the pusher, to round t; a payload of k rounds is rounds
      t .. t+k-1, in one message. A round is the gradient (``numel`` elements)
      and, when the spec lists ``per_round`` settings, their values for that
      round (:func:`pack_round`); pushers that disagree on them are refused.
      Once all ``pushers`` have pushed round t and rounds 1 .. t-1 are applied,
      the optimizer (``options["optimizer"]``, see :func:`optimizer_spec`) takes
      one step with their sum, summed in rank order, under the round's settings.
    - PULL of round r is answered once at least r - ``options["staleness"]``
      rounds are applied; GET at once. An answer is the value followed by the
      number of rounds applied (``numel + 1`` elements; :func:`unpack_counts`
      reads the last), so a worker knows which of its own pushes the value holds.
    - GET of round :data:`WHOLE_STATE` answers the whole state: the value, the
      optimizer's state tensors in name order (Adam: ``exp_avg``, ``exp_avg_sq``,
      ``step``; zeros before the first step) and the rounds applied
      (:func:`optimizer_state_numel` elements). A SET of that size restores it all
      (a checkpoint's resume); a SET of ``numel`` elements replaces the value only.

    The optimizer is elementwise (SGD, Adam, AdamW, ...), so a key that is a
    slice of a tensor steps exactly as the whole tensor would: synchronous
    training's optimizer on the global gradient, wherever the gradients came from.
    """

    def __init__(self, decl: Declaration, respond: Respond) -> None:
        super().__init__(decl, respond)
        check_full_precision(decl, "an optimizer store")
        self.param = torch.zeros(decl.numel, dtype=decl.torch_dtype, requires_grad=True)
        spec = decl.options["optimizer"]
        self.optimizer = _build_optimizer(spec, self.param)
        # The settings each round carries: (name, how many values), after the gradient.
        self.per_round = [(n, len(setting_values(spec["settings"][n]) or ())) for n in
                          spec.get("per_round", ())]
        ratio = 8 // self.param.element_size()  # float64 bits in the key's dtype
        self.width = decl.numel + ratio * sum(k for _, k in self.per_round)
        self.staleness = int(decl.options.get("staleness", 0))
        self.layout = state_layout(spec)
        self.whole = optimizer_state_numel(spec, decl.numel)
        self.rounds: dict[int, dict[tuple[int, int], torch.Tensor]] = {}
        self.settings: dict[int, torch.Tensor] = {}  # round -> its settings' values
        self.last: torch.Tensor | None = None  # the settings the optimizer holds
        self.applied = 0
        self.waiting: list[Request] = []

    def handle(self, req: Request) -> None:
        if req.op == Op.SET:
            payload = self.payload(req)  # none for a key of no elements
            if payload.numel() == self.whole:
                self._load(payload)
            elif payload.numel() == self.decl.numel:
                with torch.no_grad():
                    self.param.copy_(payload)
            else:
                raise self.fail(req, f"a SET takes the value ({self.decl.numel} elements) "
                                     f"or the whole state ({self.whole}), not "
                                     f"{payload.numel()}")
        elif req.op == Op.PUSH:
            payload = self.payload(req)
            if req.round <= self.applied:
                raise self.fail(req, f"round {req.round} is already applied")
            # A round of no elements (no gradient, no settings) is one round per push.
            count, rest = (divmod(payload.numel(), self.width) if self.width
                           else (1, payload.numel()))
            if rest or not count:
                raise self.fail(req, f"a payload of {payload.numel()} elements is not a "
                                     f"whole number of rounds of {self.width}")
            for j, record in enumerate(payload.view(count, self.width)):
                rnd = req.round + j
                pushes = self.rounds.setdefault(rnd, {})
                if req.pusher in pushes:
                    raise self.fail(req, f"this rank already pushed round {rnd}")
                values = record[self.decl.numel:].clone().view(torch.float64)
                agreed = self.settings.setdefault(rnd, values)
                if not torch.equal(agreed, values):
                    raise self.fail(req, f"the pushers disagree on the optimizer's settings "
                                         f"of round {rnd}: {self._describe(agreed)} against "
                                         f"{self._describe(values)}; every worker must use "
                                         f"the same settings and learning-rate schedule")
                pushes[req.pusher] = record[:self.decl.numel]
                if len(pushes) > self.decl.pushers:
                    raise self.fail(req, f"more pushers than the {self.decl.pushers} declared")
            self._apply_ready()
        elif req.op == Op.PULL:
            if self._ready(req):
                self._answer(req)
            else:
                self.waiting.append(req)
        elif req.op == Op.GET and req.round == WHOLE_STATE:
            self._answer_whole(req)
        elif req.op == Op.GET:
            self._answer(req)
        else:
            raise self.fail(req, "an optimizer store answers SET, PUSH, PULL and GET only")

    def _answer_whole(self, req: Request) -> None:
        n, dtype = self.decl.numel, self.param.dtype
        state = self.optimizer.state.get(self.param, {})
        parts = [self.param.detach()]
        for name, per, _ in self.layout:
            value = state.get(name)
            parts.append(torch.zeros(n if per else 1, dtype=dtype) if value is None
                         else value.detach().reshape(-1).to(dtype))
        parts.append(pack_counts([self.applied], dtype))
        self.respond(req, torch.cat(parts))

    def _load(self, whole: torch.Tensor) -> None:
        """Restore what a whole-state GET answered: value, optimizer state, rounds applied."""
        n = self.decl.numel
        with torch.no_grad():
            self.param.copy_(whole[:n])
        at, state = n, {}
        for name, per, dtype in self.layout:
            k = n if per else 1
            chunk = whole[at:at + k]
            state[name] = chunk.clone() if per else chunk.reshape(()).to(dtype)
            at += k
        self.optimizer.state.pop(self.param, None)
        if any(bool(v.any()) for v in state.values()):  # all zero: never stepped, none
            self.optimizer.state[self.param] = state
        [self.applied] = unpack_counts(whole[-1:])
        self.last = None  # the next round sets its settings

    def _apply_ready(self) -> None:
        stepped = False
        while len(self.rounds.get(self.applied + 1, ())) == self.decl.pushers:
            self.param.grad = _rank_sum(self.rounds.pop(self.applied + 1), self.param.dtype)
            values = self.settings.pop(self.applied + 1)
            if self.last is None or not torch.equal(values, self.last):
                self._set(values)  # a schedule's change (most rounds change nothing)
                self.last = values
            self.optimizer.step()
            self.param.grad = None
            self.applied += 1
            stepped = True
        if stepped:
            self.waiting = _release(self.waiting, self._ready, self._answer)

    def _set(self, values: torch.Tensor) -> None:
        group, at = self.optimizer.param_groups[0], 0
        for name, k in self.per_round:
            chunk = values[at:at + k].tolist()
            at += k
            current = group[name]
            if isinstance(current, torch.Tensor):
                current.fill_(chunk[0])
            else:
                group[name] = tuple(chunk) if isinstance(current, (list, tuple)) else chunk[0]

    def _describe(self, values: torch.Tensor) -> str:
        flat, at, parts = values.tolist(), 0, []
        for name, k in self.per_round:
            parts.append(f"{name}={flat[at] if k == 1 else tuple(flat[at:at + k])}")
            at += k
        return ", ".join(parts)

    def waiting_for(self, round: int) -> str:
        return applied_waiting(self.applied, dict(self.rounds), self.decl.pushers)

    def _ready(self, req: Request) -> bool:
        return self.applied >= req.round - self.staleness

    def _answer(self, req: Request) -> None:
        self.respond(req, torch.cat([self.param.detach(),
                                     pack_counts([self.applied], self.param.dtype)]))


STORES: dict[int, type[Store]] = {Kind.SUM: SumStore, Kind.PARAM: ParamStore,
                                  Kind.OPTIM: OptimizerStore}
_NAMES: dict[int, str] = {Kind.SUM: "sum", Kind.PARAM: "parameter", Kind.OPTIM: "optimizer"}


def register_store(kind: int, store: type[Store], name: str | None = None) -> None:
    """Teach servers a new store kind: declarations of ``kind`` get a ``store``.

    ``name`` says what the kind is in messages (default: the class name without
    ``Store``). A number taken by another class is refused. Servers learn kinds
    at import, so register in a module that every process imports (the
    strategy's own, say) before :func:`polytrain.init`.

    Example::

        class MaxStore(SumStore):
            def _sum(self, pushes): ...
        register_store(100, MaxStore, "max")
    """
    if not isinstance(kind, int) or kind < 1:
        raise ConfigError(f"a store kind is a positive int (got {kind!r})",
                          "pick a number above 16 for your own kinds")
    known = STORES.get(kind)
    if known is not None and known is not store:
        raise ConfigError(f"store kind {kind} is taken by {known.__name__} "
                          f"({store_name(kind)})", "pick another number for "
                          f"{store.__name__}")
    STORES[kind] = store
    _NAMES[kind] = name or store.__name__.removesuffix("Store").lower() or str(kind)


def store_name(kind: int) -> str:
    """What store kind ``kind`` is, in words (``sum``, ``optimizer``, ...)."""
    return _NAMES.get(kind, f"unknown kind {kind}")
