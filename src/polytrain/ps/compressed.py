"""The compressed sum store: decompress every push, sum in rank order, compress the sum again.

BytePS's server-side compression (Jiang et al., OSDI 2020): a key's pushes
are packed payloads (:mod:`polytrain.ps.compression`); once a round's pushes
are all in, the store decodes each, adds them in the pushers' order,
compresses the sum with its own error feedback (what this compression drops
is added to the next round's sum) and answers the packed sum. The
declaration fixes every size: ``numel`` is the payload's bytes (uint8) and
``options`` carry the compressor, the tensor's ``numel``, its ``segments``
(the fused tensors' lengths, when it holds several) and the feedback flag,
so a worker posts its receive before it pushes.

A GET of round ``stores.WHOLE_STATE`` answers the codec's state (the error
feedback's residual and the random compressors' generator: ``Codec.state``),
and a SET of that size restores it, so a checkpoint carries it across a restart.
"""

from __future__ import annotations

import torch

from ..errors import CommError
from .compression import Codec, CompressOptions, compressor
from .protocol import Kind, Op, Request
from .stores import WHOLE_STATE, Declaration, Respond, SumStore, register_store

__all__ = ["CompressedSumStore"]


class CompressedSumStore(SumStore):
    """A :class:`~polytrain.ps.stores.SumStore` over packed payloads (kind ``Kind.COMPRESSED``)."""

    def __init__(self, decl: Declaration, respond: Respond) -> None:
        super().__init__(decl, respond)
        codec = compressor(str(decl.options["compressor"]))
        if codec is None or decl.torch_dtype != torch.uint8:
            raise CommError(f"server: {decl.describe()}: a compressed sum store holds uint8 "
                            f"payloads of a compressor (got {decl.options['compressor']!r})")
        numel = int(decl.options["numel"])
        segments = decl.options.get("segments")
        self.codec = Codec(CompressOptions(codec, bool(decl.options.get("error_feedback"))),
                           numel, seed=decl.key,
                           segments=None if segments is None else tuple(map(int, segments)))
        if self.codec.nbytes != decl.numel:
            raise CommError(f"server: {decl.describe()}: {codec.spec()} of {numel} elements "
                            f"takes {self.codec.nbytes} bytes, not {decl.numel}")

    def handle(self, req: Request) -> None:
        if req.op == Op.GET and req.round == WHOLE_STATE:
            self.respond(req, self.codec.state())
        elif req.op == Op.SET:
            assert req.payload is not None
            want = Codec.state_bytes(self.codec.numel)
            if req.payload.numel() != want:
                raise self.fail(req, f"a SET restores the codec's state ({want} bytes), not "
                                     f"{req.payload.numel()} bytes")
            if self.rounds:
                raise self.fail(req, f"a SET of the codec's state came while rounds "
                                     f"{sorted(self.rounds)} are in progress")
            self.codec.load_state(req.payload)
        else:
            super().handle(req)

    def _sum(self, pushes: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor:
        total = None
        for pusher in sorted(pushes):  # rank order: the sum does not depend on arrival order
            x = self.codec.decode(pushes[pusher])
            total = x if total is None else total.add_(x)
        assert total is not None
        return self.codec.encode(total)


register_store(Kind.COMPRESSED, CompressedSumStore, "compressed sum")
