"""Herring's plan as plain data: balanced fusion buffers, each cut into one shard per machine.

Gradients join a buffer in the order backward produces them (the model's
parameters reversed) until it holds ``bucket_cap_bytes``; every buffer, the
last partly filled one too, is cut into equal shards by elements, shard i to
server machine i of S (the worker machines' own servers, then the dedicated
CPU machines). A CPU machine that runs several server processes cuts its
shard into as many equal parts, one a process: its NIC moves one shard, as
a machine of one (a shard a process moved c times a machine's share with c
of them: 1.71 M against ring all-reduce's 1.5 M for n = 4, c = 3).
Inside a machine of L workers each part is cut again into L pieces, piece j
handled by local worker j: the machine's reduce-scatter, so each worker owns
1/L of every buffer and pushes only its pieces.

With n worker machines and k dedicated CPU machines, all colocated, every shard is
M / (n + k) of the model M, and per step

    worker machine: sends (n - 1 + k) shards of M/(n+k) to the other servers and
                    answers n - 1 pulls of its own server's: M (2n + k - 2) / (n + k)
    CPU machine:    receives n pushes of its shard: n M / (n + k)

k = 0 gives ring all-reduce's 2 (n - 1) M / n.

Example::

    >>> import torch
    >>> from polytrain.comm import TensorSpec
    >>> specs = [TensorSpec("w", (100,), torch.float32), TensorSpec("b", (10,), torch.float32)]
    >>> plan = plan_herring(specs, bucket_cap_bytes=1 << 20, servers=[4, 5, 6], local_workers=2)
    >>> [(p.offset, p.numel) for p in plan.placement.partitions][:3], plan.bytes_by_server()
    ([(0, 19), (19, 18), (37, 19)], {4: 148, 5: 148, 6: 144})
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...comm.bucket import Bucket, plan_buckets
from ...comm.partition import Partition, TensorSpec, even_cuts
from ...errors import ConfigError
from ...ps.grads import bucket_specs
from ...ps.placement import Placement

__all__ = ["HerringPlan", "plan_herring", "herring_traffic"]


@dataclass(frozen=True)
class HerringPlan:
    """Herring's buffers and where their shards go.

    Attributes:
        buckets: the fusion buffers (members index the parameter specs), backward order.
        specs: one flat spec per buffer (what the engine sums).
        placement: per buffer, S x L pieces (server i, local worker j), owners and handlers.
        servers: the server ranks, in shard order (a CPU machine's several together).
    """

    buckets: tuple[Bucket, ...]
    specs: tuple[TensorSpec, ...]
    placement: Placement
    servers: tuple[int, ...]

    def bytes_by_server(self) -> dict[int, int]:
        return self.placement.bytes_by_owner()

    def describe(self) -> str:
        load = self.bytes_by_server()
        return (f"herring: {len(self.buckets)} fusion buffers, each in equal shards (one per "
                f"server machine); bytes per server: "
                + ", ".join(f"rank {s} {load.get(s, 0)}" for s in self.servers))


def plan_herring(specs: Sequence[TensorSpec], *, bucket_cap_bytes: int,
                 servers: Sequence[int | Sequence[int]], local_workers: int = 1) -> HerringPlan:
    """Herring's buffers of ``specs`` (parameters in model order) and their shards.

    ``servers``: a rank per server machine, or a machine's ranks together (its shard cut
    into as many equal parts). A buffer of fewer elements than its pieces (a lone scalar
    of another dtype, say) is cut into as many shards and pieces as it has elements, on
    machines taken in turn from the buffer's index. Raises ConfigError for a cap of zero or
    below, or no servers.
    """
    if bucket_cap_bytes < 1:
        raise ConfigError(f"herring's bucket cap must be positive (got {bucket_cap_bytes} "
                          f"bytes)", "pass bucket_cap_mb=25 (--bucket-cap-mb 25), or any "
                          "size above 0")
    machines = [tuple(m) if isinstance(m, Sequence) else (m,) for m in servers]
    if not machines or not all(machines):
        raise ConfigError("herring needs summation servers, but this run has none",
                          "keep the colocated servers (leave out --no-colocate) or pass "
                          "--servers K")
    if local_workers < 1:
        raise ConfigError(f"a machine needs at least one worker (got {local_workers})",
                          "start workers on every machine")
    buckets = plan_buckets(specs, cap_bytes=bucket_cap_bytes, reverse=True)
    flat = bucket_specs(buckets, specs)
    parts: list[Partition] = []
    owners: list[int] = []
    handlers: list[int] = []
    for b, spec in enumerate(flat):
        shards = max(1, min(len(machines), spec.numel))
        index = 0
        for i, (start, count) in enumerate(even_cuts(spec.numel, shards)):
            # A buffer on fewer machines than all: on the next ones in turn.
            ranks = machines[(i + (b if shards < len(machines) else 0)) % len(machines)]
            for rank, (first, size) in zip(ranks, even_cuts(count, max(1, min(len(ranks),
                                                                              count)))):
                for j, (off, n) in enumerate(even_cuts(size, max(1, min(local_workers, size)))):
                    parts.append(Partition(len(parts), b, spec.name, index,
                                           start + first + off, n, n * spec.itemsize,
                                           spec.dtype))
                    owners.append(rank)
                    handlers.append(j)
                    index += 1
    return HerringPlan(buckets, tuple(flat),
                       Placement(tuple(parts), tuple(owners), tuple(handlers)),
                       tuple(rank for m in machines for rank in m))


def herring_traffic(machines: int, dedicated: int, *, colocated: bool = True
                    ) -> dict[str, float]:
    """Bytes per step in units of the model: each worker machine's sent (= received) and each
    CPU machine's received (= sent), with every shard M / S."""
    n, k = machines, dedicated
    s = (n if colocated else 0) + k
    if s == 0:
        raise ConfigError("herring needs summation servers (got none)", "pass --servers K")
    own = 1 if colocated else 0
    # Push every shard but the own server's; answer the n - 1 other machines' pulls of it.
    worker = (s - own) / s + (own * (n - 1)) / s
    return {"worker": worker, "server": n / s if k else 0.0}


