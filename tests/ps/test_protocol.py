import torch

from polytrain.ps.protocol import (
    HEADER_BYTES,
    INLINE_BYTES,
    Op,
    Request,
    message_length,
    request,
)
from polytrain.ps.server import _RequestBuffers


def received(message: torch.Tensor, size: int = 4096) -> torch.Tensor:
    """``message`` as a server holds it: at the start of a larger buffer (gloo writes the
    message's bytes and leaves the rest)."""
    buf = torch.full((size,), 255, dtype=torch.uint8)
    buf[:message.numel() * message.element_size()] = message.view(-1).view(torch.uint8)
    return buf


def test_a_request_and_its_payload_are_one_message() -> None:
    for payload in (torch.arange(10, dtype=torch.float32), torch.arange(7, dtype=torch.float64),
                    torch.tensor([True, False, True]), torch.arange(5, dtype=torch.uint8)):
        msg = request(Op.PUSHPULL, key=3, round=9, seq=41, lane=1, payload=payload)
        assert msg.numel() == HEADER_BYTES + payload.numel() * payload.element_size()
        buf = received(msg)
        assert message_length(buf) == msg.numel()
        req = Request.parse(5, buf)
        assert (req.op, req.key, req.round, req.seq, req.lane) == (Op.PUSHPULL, 3, 9, 41, 1)
        assert req.payload is not None and req.payload.dtype == payload.dtype
        assert torch.equal(req.payload, payload)


def test_a_request_without_payload_is_its_header() -> None:
    msg = request(Op.PULL, key=2, round=1, seq=7)
    assert msg.numel() * msg.element_size() == HEADER_BYTES
    req = Request.parse(3, received(msg))
    assert req.op == Op.PULL and req.numel == 0 and req.payload is None
    assert message_length(received(msg)) == HEADER_BYTES


def test_a_payload_over_the_inline_limit_follows_its_header() -> None:
    big = torch.zeros(INLINE_BYTES // 4 + 1, dtype=torch.float32)
    msg = request(Op.PUSH, key=1, seq=2, payload=big)
    assert msg.numel() * msg.element_size() == HEADER_BYTES  # the header alone
    req = Request.parse(0, received(msg))
    assert req.numel == big.numel() and not req.inline and req.payload is None
    assert message_length(received(msg)) == HEADER_BYTES


def test_a_request_buffer_is_reused_only_once_no_view_of_it_is_left() -> None:
    buffers = _RequestBuffers(keep=2)
    first = buffers.take()
    ptr = first.data_ptr()
    kept = first[HEADER_BYTES:HEADER_BYTES + 16].view(torch.float32)  # a store keeps a payload
    del first
    second = buffers.take()
    assert second.data_ptr() != ptr
    del kept
    assert buffers.take().data_ptr() == ptr
    assert len(buffers) == 2


def test_request_buffers_keep_few_free_ones() -> None:
    # A burst of held payloads makes many buffers; once free, only `keep` of them stay.
    buffers = _RequestBuffers(keep=2)
    held = [buffers.take() for _ in range(5)]
    assert len(buffers) == 5
    del held
    buffers.take()
    assert len(buffers) == 2


def test_held_payloads_pin_a_bounded_number_of_buffers() -> None:
    # Each held payload of over 64 KiB keeps its 4 MiB buffer, up to `pinned` buffers in
    # use; past that the server copies payloads out, and small ones always.
    buffers = _RequestBuffers(keep=2, pinned=3)
    payload = 256 << 10
    held = []
    for _ in range(3):
        held.append(buffers.take())
        assert buffers.hold(payload)
    assert not buffers.hold(1 << 10)  # small: copied whatever the count
    held.append(buffers.take())  # a fourth in use: copy it out
    assert not buffers.hold(payload)
    held.pop()  # its copy kept, the buffer freed
    assert buffers.hold(payload)
    del held[:2]
    assert buffers.hold(payload)
    assert len(buffers) == 4
