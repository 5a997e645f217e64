"""Synthetic-data benchmark in the form of BytePS's example/pytorch/benchmark_byteps.py.

Only the import line differs from a ``byteps.torch`` script (a tiny model instead of
torchvision's, so that it runs on two CPU cores; ``--log-json`` for the test to read).
"""

import argparse
import json
import timeit

import numpy as np
import torch
import torch.nn.functional as F
import torch.optim as optim
from torch import nn

import polytrain.byteps as bps

parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-pushpull", action="store_true", default=False,
                    help="use fp16 compression during pushpull")
parser.add_argument("--batch-size", type=int, default=8, help="input batch size")
parser.add_argument("--num-warmup-batches", type=int, default=1,
                    help="number of warm-up batches that don't count towards benchmark")
parser.add_argument("--num-batches-per-iter", type=int, default=2,
                    help="number of batches per benchmark iteration")
parser.add_argument("--num-iters", type=int, default=3, help="number of benchmark iterations")
parser.add_argument("--no-cuda", action="store_true", default=False,
                    help="disables CUDA training")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--log-json", default=None, help="rank 0 writes its losses here")
args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()

bps.init()
torch.manual_seed(args.seed)

if args.cuda:
    torch.cuda.set_device(bps.local_rank())

model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.Flatten(),
                      nn.Linear(8 * 15 * 15, 64), nn.ReLU(), nn.Linear(64, 10))
if args.cuda:
    model.cuda()

optimizer = optim.SGD(model.parameters(), lr=0.01)

# BytePS: (optional) compression algorithm.
compression = bps.Compression.fp16 if args.fp16_pushpull else bps.Compression.none

# BytePS: wrap optimizer with DistributedOptimizer.
optimizer = bps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression)

# BytePS: broadcast parameters & optimizer state.
bps.broadcast_parameters(model.state_dict(), root_rank=0)
bps.broadcast_optimizer_state(optimizer, root_rank=0)

# Set up fixed fake data (different on every worker, as each worker draws its own).
generator = torch.Generator().manual_seed(args.seed + bps.rank())
data = torch.randn(args.batch_size, 3, 32, 32, generator=generator)
target = torch.randint(0, 10, (args.batch_size,), generator=generator)
if args.cuda:
    data, target = data.cuda(), target.cuda()
losses = []


def benchmark_step():
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())


def log(s, nl=True):
    if bps.rank() != 0:
        return
    print(s, end="\n" if nl else "")


log(f"Batch size: {args.batch_size}")
device = "GPU" if args.cuda else "CPU"
log(f"Number of {device}s: {bps.size()}")

# Warm-up
log("Running warmup...")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)

# Benchmark
log("Running benchmark...")
img_secs = []
for x in range(args.num_iters):
    time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / time
    log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
    img_secs.append(img_sec)

# Results
img_sec_mean = np.mean(img_secs)
img_sec_conf = 1.96 * np.std(img_secs)
log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
log(f"Total img/sec on {bps.size()} {device}(s): {bps.size() * img_sec_mean:.1f} "
    f"+-{bps.size() * img_sec_conf:.1f}")
if args.log_json and bps.rank() == 0:
    with open(args.log_json, "w") as f:
        json.dump({"losses": losses, "img_sec": img_secs}, f)
