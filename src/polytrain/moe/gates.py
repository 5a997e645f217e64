"""Gates: which experts each token goes to, with what weight, and the gate's auxiliary loss.

A gate maps (tokens, d_model) to ``(indices, scores)``, both (tokens, top_k):
the expert of every slot (-1: dropped, contributes nothing) and its weight in
the combination. After each forward, ``gate.loss`` holds its weighted
auxiliary loss (balance and router z-loss; None if it has none), which
:func:`polytrain.moe.aux_loss` collects: the loss of its last call, so a layer
applied twice in one forward counts its second call's alone.

Gates that draw random numbers (noise, random routing, jitter) take one seed
per forward from torch's global generator, so ``torch.manual_seed`` before a
forward repeats their decisions exactly.

With a *batch group*, data parallelism does not change what a gate decides
while training, or the loss it adds. The batch group is the set of ranks
whose tokens, concatenated in rank order, make the global batch (default:
the expert-parallel group; :func:`polytrain.distribute` sets it to all
workers for every data-parallel strategy). While training with autograd on,
over it:

- random numbers are a function of rank 0's seed and the token's place in
  the global batch (:mod:`polytrain.moe.draws`), so one process holding the
  whole batch draws the same numbers for the same tokens, and each rank
  computes only its own;
- capacity is decided from every rank's counts;
- the auxiliary losses are computed from statistics summed over the group
  (one all-reduce), so every rank holds the global batch's loss. Its
  gradient is scaled by the group's size, as gradients are then averaged
  over the group (DDP's convention, and ``--strategy moe``'s): the mean of
  the ranks' gradients is the global loss's gradient.

In evaluation and under ``torch.no_grad()`` a gate routes as before a batch
group was given (capacity over the expert-parallel group, losses of its own
tokens), so a forward on one rank alone needs no other rank. The tokens'
order is their order in ``x``: a layer fed (sequence, batch, d) tokens, as
``nn.TransformerEncoderLayer`` with ``batch_first=False`` is, has the
sequence major and is not split by samples the same way.
"""

from __future__ import annotations

import inspect
import math
import numbers
import operator
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, unknown
from ..kinds import plain
from ..tensors import sum_dtype
from .capacity import allowance, check_factor, check_number, expert_capacity, keep_mask
from .draws import new_seed, normal, uniform
from .exchange import ExpertGroup, all_gather_counts

__all__ = ["Gate", "NaiveGate", "NoisyGate", "GShardGate", "SwitchGate", "make_gate",
           "gate_names", "has_default_capacity", "balance_loss", "z_loss"]


def _balance_sums(probs: torch.Tensor, top1: torch.Tensor) -> dict[str, torch.Tensor]:
    # Per-expert sums over tokens: router probabilities (with grad) and first choices.
    # Sums over tokens: a float16 one is inf when most of 65504+ tokens choose one expert.
    experts, acc = probs.shape[1], sum_dtype(probs.dtype)
    first = torch.bincount(top1.clamp(min=0), minlength=experts).to(acc)
    return {"probs": probs.to(acc).sum(0), "first": first}


def _balance_of(sums: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    if not tokens:
        return sums["probs"].sum() * 0.0
    experts = sums["probs"].numel()
    return experts * ((sums["first"] / tokens) * (sums["probs"] / tokens)).sum()


def balance_loss(probs: torch.Tensor, top1: torch.Tensor) -> torch.Tensor:
    """GShard's and Switch's ``E * sum_e f_e * P_e`` (= ``mean_e(c_e m_e) * E^2``).

    ``f_e``: fraction of tokens whose first choice is e; ``P_e``: mean router probability of e.
    """
    return _balance_of(_balance_sums(probs, top1), probs.new_tensor(float(probs.shape[0])))


def _z_sum(logits: torch.Tensor) -> torch.Tensor:
    # The router z-loss's sum over tokens: sum(logsumexp(logits)^2).
    return torch.logsumexp(logits, dim=-1).square().sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: ``mean(logsumexp(logits)^2)``; keeps router logits small."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return _z_sum(logits) / logits.shape[0]


def _global_sums(local: dict[str, torch.Tensor], group: ExpertGroup) -> dict[str, torch.Tensor]:
    """Each sum over the whole batch group, its gradient flowing to this rank's part only."""
    if not group.distributed:
        return local
    parts = [t.detach().reshape(-1).double() for t in local.values()]  # counts stay exact
    wire = group.wire_device(parts[0].device)
    flat = torch.cat(parts).to(wire)
    dist.all_reduce(flat, group=group.group)
    out, start = {}, 0
    for name, t in local.items():
        total = flat[start:start + t.numel()].reshape(t.shape).to(t.device, t.dtype)
        start += t.numel()
        out[name] = total - t.detach() + t
    return out


def _cv_squared(x: torch.Tensor) -> torch.Tensor:
    # Shazeer et al.'s squared coefficient of variation; 0 for a single expert.
    if x.numel() < 2:
        return x.sum() * 0.0
    x = x.float()
    return x.var() / (x.mean().square() + 1e-10)


class Gate(nn.Module):
    """A linear router plus what every gate shares: capacity, drops, auxiliary losses.

    Subclasses implement :meth:`route` and :meth:`balance`. Capacity (when a factor
    applies) is decided over the whole group in force (:attr:`batch`) from all-gathered counts
    (:mod:`polytrain.moe.capacity`), so every rank agrees and the kept slots are
    those a single process with every token would keep.

    Args:
        d_model: token width. num_experts: experts in all (over the whole group).
        top_k: experts per token (default: the gate's own, 2; switch 1).
        capacity_factor: training capacity factor (None: the gate's default; naive
            and noisy have none); eval_capacity_factor: in eval mode (default: the
            gate's eval default, else capacity_factor).
        dropless: never drop a slot for capacity (no capacity factor may be given; a
            gate that drops only with a factor given, naive or noisy, refuses it). True,
            False, numpy's, or 1 or 0.
        balance_weight: weight of the balance loss (default: the gate's, 0.01; naive none).
        z_loss_weight: weight of the router z-loss (default 0: off).
        group: the expert-parallel process group (default None: no expert parallelism).
        batch_group: the ranks whose tokens make the global batch, over which
            gradients are averaged (default: ``group``); see the module's text.
    """

    name: ClassVar[str] = ""
    default_top_k: ClassVar[int] = 2
    default_capacity: ClassVar[tuple[float | None, float | None]] = (None, None)
    default_balance_weight: ClassVar[float] = 0.0
    has_balance_loss: ClassVar[bool] = True

    def __init__(self, d_model: int, num_experts: int, *, top_k: int | None = None,
                 capacity_factor: float | None = None, eval_capacity_factor: float | None = None,
                 dropless: bool = False, balance_weight: float | None = None,
                 z_loss_weight: float = 0.0, group: Any | None = None,
                 batch_group: Any | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        k: object = self.default_top_k if top_k is None else top_k
        # (2.5 met torch's topk() at a forward; numpy's int64 2 was refused as "got 2")
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or \
                not 1 <= int(k) <= num_experts:
            raise ConfigError(f"top_k (--top-k) must be between 1 and the number of experts "
                              f"{num_experts} (got {k})",
                              f"pass top_k (--top-k) in 1..{num_experts}")
        self.top_k = int(k)
        capped = self.default_capacity != (None, None)  # (naive, noisy: only a factor given)
        capacity_factor = check_factor(capacity_factor, no_limit="--dropless" if capped else
                                       "leave --capacity-factor out")
        eval_capacity_factor = check_factor(eval_capacity_factor, "eval_capacity_factor")
        flag = _flag(dropless)
        if flag is None:  # ("no" was taken as true)
            raise ConfigError(f"dropless (--dropless) must be True or False (got {dropless!r})",
                              "pass dropless=True for no capacity limit, or leave it out")
        dropless = flag
        if dropless and (capacity_factor is not None or eval_capacity_factor is not None):
            raise ConfigError(f"a dropless gate (--dropless) has no capacity (got "
                              f"capacity_factor {capacity_factor}, eval_capacity_factor "
                              f"{eval_capacity_factor})",
                              "leave out --capacity-factor (and eval_capacity_factor in a "
                              "script), or --dropless")
        if dropless and not capped:  # (it did nothing: refused as a balance loss for naive)
            raise ConfigError(f"the {self.name} gate drops slots only with a capacity factor, "
                              f"which dropless (--dropless) refuses, so dropless would do "
                              f"nothing", f"leave dropless out (without --capacity-factor the "
                              f"{self.name} gate never drops), or use gate gshard or switch, "
                              f"whose default capacity dropless lifts")
        train_cf, eval_cf = (None, None) if dropless else self.default_capacity
        self.capacity_factor = capacity_factor if capacity_factor is not None else train_cf
        # As documented: the gate's own eval factor (GShard's 2.4, Switch's 2.0) before
        # the training one; a given training factor replaced it, and evaluation dropped more.
        self.eval_capacity_factor = (eval_capacity_factor if eval_capacity_factor is not None
                                     else eval_cf if eval_cf is not None
                                     else self.capacity_factor)
        self.dropless = dropless
        self.balance_weight = self._weight("balance_weight", "--balance-loss",
                                           self.default_balance_weight if balance_weight is None
                                           else balance_weight)
        self.z_loss_weight = self._weight("z_loss_weight", "--z-loss", z_loss_weight)
        if self.balance_weight and not self.has_balance_loss:
            raise ConfigError(f"the {self.name} gate has no balance loss, so balance_weight "
                              f"(--balance-loss) {self.balance_weight:g} would do nothing",
                              "use gate gshard, switch or noisy for a balance loss, or leave "
                              "balance_weight out")
        self.wg = nn.Linear(d_model, num_experts, bias=False)
        self.group = ExpertGroup(group)
        self.batch_group: ExpertGroup | None = None
        self.set_batch_group(batch_group)
        #: The weighted auxiliary loss of the gate's last call (None if it has none): a layer
        #: applied twice in one forward (a shared block) holds its second call's alone.
        self.loss: torch.Tensor | None = None
        self.last_capacity: int | None = None

    @staticmethod
    def _weight(name: str, flag: str, weight: Any) -> float:
        """``weight`` of a loss as a Python number, refused unless it is 0 or more."""
        hint = f"pass a small weight, e.g. {flag} 0.01 ({name}=0.01 in a script), or 0 for none"
        weight = check_number(f"{name} ({flag})", weight, hint)
        if not 0 <= weight < math.inf:
            raise ConfigError(f"{name} ({flag}) must be 0 or more (got {weight})", hint)
        return weight

    def set_batch_group(self, group: Any | None) -> None:
        """Route over the global batch of ``group``'s ranks while training (None: the
        expert-parallel group's)."""
        self.batch_group = None if group is None else ExpertGroup(group)

    @property
    def _over_batch(self) -> bool:
        # Training with autograd on: the decisions and losses are the global batch's.
        return self.training and torch.is_grad_enabled()

    @property
    def batch(self) -> ExpertGroup:
        """The group the gate routes over now: the batch group while training with
        autograd on, else (evaluation, inference) the expert-parallel group, as before
        a batch group is given; a forward on one rank alone then needs no other."""
        if self.batch_group is not None and self._over_batch:
            return self.batch_group
        return self.group

    def __getstate__(self) -> dict[str, Any]:
        # The last loss belongs to the last forward's graph: copies and pickles start without;
        # a process group cannot be pickled: the batch group is the run's, not the model's.
        state = self.__dict__.copy()
        state["loss"] = None
        state["batch_group"] = None
        return state

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                               dict[str, torch.Tensor] | None]:
        """(indices, scores, logits, balance statistics or None) before capacity.

        The statistics are sums over this rank's tokens (tensors by name) from
        which :meth:`balance` computes the balance loss once they are summed
        over the batch group.
        """
        raise NotImplementedError

    def balance(self, sums: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        """The unweighted balance loss of the global batch from its statistics' sums."""
        raise NotImplementedError

    def draw(self, x: torch.Tensor, cols: int, kind: str = "uniform") -> torch.Tensor:
        """(tokens of x, cols) random numbers, those one process with the global batch draws.

        ``kind``: ``uniform`` in [0, 1) or ``normal``; float32, on x's device
        (:mod:`polytrain.moe.draws`). Every rank of the batch group calls it (one
        small all-gather: the ranks' token counts and rank 0's seed).
        """
        rows, seed, first, total = x.shape[0], new_seed(), 0, x.shape[0]
        group = self.batch
        if group.distributed:
            mine = torch.tensor([rows, seed], device=x.device)
            every = all_gather_counts(mine, group)                       # (ranks, 2)
            seed, first = int(every[0, 1]), int(every[:group.rank, 0].sum())
            total = int(every[:, 0].sum())
        make = normal if kind == "normal" else uniform
        return make(seed, first, rows, cols, total, x.device)

    @property
    def factor(self) -> float | None:
        """The capacity factor in force (training or eval), None for no capacity."""
        return self.capacity_factor if self.training else self.eval_capacity_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, d_model) -> indices (tokens, top_k) int64 and scores (tokens, top_k)."""
        indices, scores, logits, stats = self.route(x)
        self.loss = self._aux_loss(x, logits, stats)
        self.last_capacity = None
        if self.factor is not None:
            indices = self._apply_capacity(indices, self.factor)
        return indices, scores.masked_fill(indices < 0, 0.0)

    def _aux_loss(self, x: torch.Tensor, logits: torch.Tensor,
                  stats: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
        balanced = stats is not None and bool(self.balance_weight)
        if not balanced and not self.z_loss_weight:
            return None
        acc = sum_dtype(logits.dtype)
        local = {k: v.to(acc) for k, v in stats.items()} if balanced and stats else {}
        if self.z_loss_weight:
            local["z"] = _z_sum(logits.to(acc))
        local["tokens"] = torch.tensor(float(x.shape[0]), dtype=acc, device=logits.device)
        # Summed over the batch group while training (evaluation and inference: this rank's).
        group = self.batch if self._over_batch else ExpertGroup(None)
        sums = _global_sums(local, group)
        ranks = group.size
        tokens = sums["tokens"].detach()
        loss = torch.zeros((), dtype=acc, device=logits.device)
        if balanced:
            loss = loss + self.balance_weight * self.balance(sums, tokens)
        if self.z_loss_weight and tokens:
            loss = loss + self.z_loss_weight * sums["z"] / tokens
        # The ranks' gradients are averaged: each carries the whole loss's gradient for its part.
        return loss + (ranks - 1) * (loss - loss.detach()) if ranks > 1 else loss

    def _apply_capacity(self, indices: torch.Tensor, factor: float) -> torch.Tensor:
        tokens, k = indices.shape
        valid = indices >= 0
        onehot = F.one_hot(indices.clamp(min=0), self.num_experts) * valid.unsqueeze(-1)
        mine = torch.cat([onehot.sum(0).flatten(), torch.tensor([tokens], device=indices.device)])
        group = self.batch
        every = all_gather_counts(mine, group)                           # (ranks, k*E + 1)
        counts = every[:, :-1].reshape(-1, k, self.num_experts)
        capacity = expert_capacity(int(every[:, -1].sum()), self.num_experts, k, factor)
        allowed = allowance(counts, capacity, group.rank).to(indices.device)
        self.last_capacity = capacity
        return indices.masked_fill(~keep_mask(indices, allowed), -1)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, capacity_factor="
                f"{self.capacity_factor}, eval_capacity_factor={self.eval_capacity_factor}, "
                f"balance_weight={self.balance_weight}, z_loss_weight={self.z_loss_weight}")


class NaiveGate(Gate):
    """FastMoE's naive gate: the top-k router logits, softmax over those k."""

    name = "naive"
    has_balance_loss = False

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                               dict[str, torch.Tensor] | None]:
        logits = self.wg(x)                                               # (tokens, E)
        values, indices = logits.topk(self.top_k, dim=-1)
        return indices, F.softmax(values, dim=-1), logits, None


class NoisyGate(Gate):
    """Noisy top-k gating with its importance and load losses.

    Shazeer et al., "Outrageously Large Neural Networks: The Sparsely-Gated
    Mixture-of-Experts Layer" (ICLR 2017): learned Gaussian noise on the router
    logits while training; loss ``cv^2(importance) + cv^2(load)``, where load is
    the smooth estimate of how many tokens each expert gets (normal CDF).
    """

    name = "noisy"
    default_balance_weight = 0.01

    def __init__(self, d_model: int, num_experts: int, **kwargs: Any) -> None:
        super().__init__(d_model, num_experts, **kwargs)
        self.w_noise = nn.Linear(d_model, num_experts, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                               dict[str, torch.Tensor] | None]:
        clean = self.wg(x)
        k, experts = self.top_k, self.num_experts
        noisy = self.training and k < experts
        if noisy:
            std = F.softplus(self.w_noise(x)) + 1e-2
            logits = clean + self.draw(x, experts, "normal").to(clean.dtype) * std
        else:
            logits = clean
        top_values, top_indices = logits.topk(min(k + 1, experts), dim=-1)
        scores = F.softmax(top_values[:, :k], dim=-1)
        indices = top_indices[:, :k]
        acc = sum_dtype(clean.dtype)
        importance = torch.zeros_like(clean, dtype=acc).scatter(1, indices, scores.to(acc)).sum(0)
        if noisy and x.shape[0]:
            # P(expert e stays in the top k if only its noise were drawn again).
            normal = torch.distributions.Normal(0.0, 1.0)
            in_threshold = top_values[:, k:k + 1]
            out_threshold = top_values[:, k - 1:k]
            is_in = logits > in_threshold
            p_in = normal.cdf((clean - in_threshold) / std)
            p_out = normal.cdf((clean - out_threshold) / std)
            load = torch.where(is_in, p_in, p_out).to(acc).sum(0)
        else:
            load = (torch.zeros_like(clean, dtype=acc).scatter(1, indices, 1.0)).sum(0)
        return indices, scores, logits, {"importance": importance, "load": load}

    def balance(self, sums: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        return _cv_squared(sums["importance"]) + _cv_squared(sums["load"])


class GShardGate(Gate):
    """GShard's gate: top-2 with capacity, random routing of the second expert, balance loss.

    Lepikhin et al., "GShard" (ICLR 2021). Scores are the softmax probabilities
    of the chosen experts renormalised over them (raw for top_k 1); while
    training, slot s >= 1 is kept with probability ``min(1, 2 * score_s)``.
    Capacity factor 1.2 while training, 2.4 in eval, unless given. Any top_k
    works; 2 is GShard's.
    """

    name = "gshard"
    default_capacity = (1.2, 2.4)
    default_balance_weight = 0.01

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                               dict[str, torch.Tensor] | None]:
        logits = self.wg(x)
        probs = F.softmax(logits, dim=-1)
        values, indices = probs.topk(self.top_k, dim=-1)
        scores = values / values.sum(-1, keepdim=True) if self.top_k > 1 else values
        if self.training and self.top_k > 1:
            draw = self.draw(x, self.top_k - 1)
            keep = draw < 2 * scores[:, 1:].detach()
            indices = torch.cat([indices[:, :1], indices[:, 1:].masked_fill(~keep, -1)], dim=1)
        return indices, scores, logits, _balance_sums(probs, indices[:, 0])

    def balance(self, sums: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        return _balance_of(sums, tokens)


class SwitchGate(Gate):
    """The Switch Transformer's gate: top-1, multiplicative jitter, capacity, balance loss.

    Fedus et al., "Switch Transformers" (JMLR 2022). While training the router
    input is multiplied by uniform noise in ``[1 - jitter, 1 + jitter]``; the
    score is the router probability of the chosen expert; capacity factor 1.25
    while training, 2.0 in eval, unless given. top_k above 1 routes to the k
    most probable experts with their raw probabilities.

    Args:
        jitter: the jitter's half-width (default 0.01; 0 for none).
    """

    name = "switch"
    default_top_k = 1
    default_capacity = (1.25, 2.0)
    default_balance_weight = 0.01

    def __init__(self, d_model: int, num_experts: int, *, jitter: float = 0.01,
                 **kwargs: Any) -> None:
        super().__init__(d_model, num_experts, **kwargs)
        jitter = check_number("jitter", jitter, "pass jitter=0.01")
        if not 0 <= jitter < 1:
            raise ConfigError(f"jitter must be in [0, 1) (got {jitter})", "pass jitter=0.01")
        self.jitter = jitter

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                               dict[str, torch.Tensor] | None]:
        if self.training and self.jitter:
            x = x * (1 - self.jitter + 2 * self.jitter * self.draw(x, x.shape[1])).to(x.dtype)
        logits = self.wg(x)
        probs = F.softmax(logits, dim=-1)
        scores, indices = probs.topk(self.top_k, dim=-1)
        return indices, scores, logits, _balance_sums(probs, indices[:, 0])

    def balance(self, sums: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        return _balance_of(sums, tokens)


_GATES: dict[str, type[Gate]] = {g.name: g for g in (NaiveGate, NoisyGate, GShardGate,
                                                     SwitchGate)}


def gate_names() -> list[str]:
    return sorted(_GATES)


def has_default_capacity(name: str) -> bool:
    """Whether gate ``name`` drops slots for capacity unless dropless (gshard, switch): naive
    and noisy drop only with a capacity factor given. An unknown name: True."""
    cls = _GATES.get(name)
    return cls is None or cls.default_capacity != (None, None)


def _flag(value: Any) -> bool | None:
    """``value`` as True or False: a bool, numpy's, or 0 or 1 (as ``operator.index`` takes
    them); None for anything else ("no" was taken as true)."""
    try:
        index = operator.index(plain(value))
    except TypeError:
        return None
    return bool(index) if index in (0, 1) else None


def _options_of(cls: type[Gate]) -> set[str]:
    """The keyword options ``cls`` takes: its own, and its bases' where it passes on
    ``**kwargs``."""
    names: set[str] = set()
    for base in cls.__mro__:
        if "__init__" not in vars(base):
            continue
        params = inspect.signature(vars(base)["__init__"]).parameters.values()
        names |= {p.name for p in params if p.kind == p.KEYWORD_ONLY
                  or (p.kind == p.POSITIONAL_OR_KEYWORD and p.name not in ("self", "d_model",
                                                                           "num_experts"))}
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return names


def make_gate(name: str, d_model: int, num_experts: int, **options: Any) -> Gate:
    """Build the gate called ``name``; the error lists the gates there are."""
    try:
        cls = _GATES[name]
    except KeyError:
        raise unknown("gate", name, gate_names(), "pass one of them, e.g. gate='gshard'") from None
    other = sorted(set(options) - _options_of(cls))
    if other:  # was TypeError: __init__() got an unexpected keyword argument
        owners = {o: [n for n, g in _GATES.items() if o in _options_of(g)] for o in other}
        said = "; ".join(f"{o} is an option of {', '.join(owners[o])}" if owners[o]
                         else f"no gate takes {o}" for o in other)
        raise ConfigError(f"gate {name!r} takes no option {', '.join(other)} ({said})",
                          f"leave {', '.join(other)} out of gate_options, or pick a gate "
                          f"that takes it")
    return cls(d_model, num_experts, **options)

