"""The MoE layer on a GPU computes what it computes on the CPU (skipped without CUDA)."""

import copy

import pytest
import torch
from torch import nn

import polytrain
from polytrain.moe import MoE, aux_loss
from polytrain.moe.dispatch import moe_apply
from polytrain.moe.experts import grouped_mm
from tests.harness import spawn

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("gate, options", [("naive", {}),
                                           ("gshard", {"capacity_factor": 0.75})])
def test_layer_on_cuda_equals_layer_on_cpu(gate, options):
    torch.manual_seed(0)
    cpu = MoE(64, 8, gate=gate, **options).eval()
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(96, 64, requires_grad=True)
    xg = x.detach().cuda().requires_grad_()
    y, yg = cpu(x), gpu(xg)
    (y.square().sum() + aux_loss(cpu)).backward()
    (yg.square().sum() + aux_loss(gpu)).backward()
    assert torch.allclose(y, yg.cpu(), atol=1e-4)
    assert torch.allclose(x.grad, xg.grad.cpu(), atol=1e-4)
    for p, q in zip(cpu.parameters(), gpu.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert torch.allclose(p.grad, q.grad.cpu(), atol=1e-3)
    with torch.no_grad():
        assert torch.allclose(gpu(xg), yg, atol=1e-5)  # streamed inference
        gpu.experts.chunk_bytes = 256 * 4 * 8  # chunks of 8 rows, experts' weights one at a time
        assert torch.allclose(gpu(xg), yg, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_inference_on_cuda_never_waits_for_the_gpu(dtype):
    # The routing stays on the device (dispatch._streamed_on_device): a host read of it
    # would wait for every kernel queued before it. Not fp32: torch 2.11's grouped matmul
    # has a kernel for bf16 only; for fp32 it loops over the groups, reading them on the host.
    torch.manual_seed(0)
    layer = MoE(64, 8, gate="naive").to("cuda", dtype).eval()
    x = torch.randn(96, 64, device="cuda", dtype=dtype)
    with torch.no_grad():
        want = layer(x)  # also the grouped matmul's one-time probe
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = layer(x)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_on_cuda(dtype):
    x = torch.randn(40, 64, device="cuda", dtype=dtype)
    w = torch.randn(3, 64, 32, device="cuda", dtype=dtype)
    b = torch.randn(3, 32, device="cuda", dtype=dtype)
    want = torch.cat([x[:16] @ w[0], x[16:40] @ w[2]])
    assert torch.allclose(grouped_mm(x, w, [16, 0, 24]).float(), want.float(), atol=0.1)
    with_bias = torch.cat([x[:16] @ w[0] + b[0], x[16:40] @ w[2] + b[2]])
    assert torch.allclose(grouped_mm(x, w, [16, 0, 24], bias=list(b)).float(),
                          with_bias.float(), atol=0.1)



def test_default_experts_under_cuda_autocast_compute_in_its_dtype():
    # Under torch.autocast a Linear -> MoE model failed: "mat1 and mat2 must have the same
    # dtype" (torch._grouped_mm and addmm(out=) are none that autocast casts). Training runs
    # the grouped matmul, inference dispatch._streamed_on_device, both in bf16 now.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), MoE(64, 8, gate="naive")).cuda()
    layer = model[1]
    x = torch.randn(96, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = model(x)
        h = model[0](x)
        indices, scores = layer.gate(h)
        with torch.no_grad():
            assert layer.experts.grouped_here(h)  # the on-device path below
            streamed = model(x)
    assert y.dtype == streamed.dtype == torch.bfloat16
    y.float().square().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad():  # float32 experts on the same routing: bf16 rounding apart
        reference, _ = moe_apply(h.float(), indices, scores.float(), layer.experts, 8)
    assert torch.allclose(y.float(), reference, atol=0.03, rtol=0.03), \
        (y.float() - reference).abs().max()
    assert torch.allclose(streamed.float(), y.float(), atol=0.03, rtol=0.03)


def nccl_expert_parallel() -> float:
    ctx = polytrain.init(device="cuda")
    torch.manual_seed(0)
    layer = MoE(32, 4, top_k=2).cuda()
    x_all = torch.randn(2 * 16, 32, device="cuda", requires_grad=True)
    y_all = layer(x_all)
    sharded = copy.deepcopy(layer)
    sharded.shard_experts(ctx.new_group(ctx.topology.workers, cuda=True))
    mine = x_all.detach()[16 * ctx.worker_index:16 * (ctx.worker_index + 1)]
    return float((sharded(mine) - y_all[16 * ctx.worker_index:][:16]).abs().max())


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_expert_parallel_over_nccl():
    assert max(spawn(nccl_expert_parallel, workers=2)) < 1e-4
