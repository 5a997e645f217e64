"""An MNIST-style training loop in the form of BytePS's example/pytorch/train_mnist_byteps.py.

Only the import line differs from a ``byteps.torch`` script. The data are synthetic
28x28 images (no download on the test machine); fc1 is 64 wide so that one tensor
(80 KB) is above the compression threshold; ``--log-json`` for the test to read.
"""

import argparse
import json

import torch
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from torch import nn

import polytrain.byteps as bps

parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
parser.add_argument("--batch-size", type=int, default=16, metavar="N",
                    help="input batch size for training")
parser.add_argument("--test-batch-size", type=int, default=32, metavar="N",
                    help="input batch size for testing")
parser.add_argument("--epochs", type=int, default=2, metavar="N", help="epochs to train")
parser.add_argument("--lr", type=float, default=0.01, metavar="LR", help="learning rate")
parser.add_argument("--momentum", type=float, default=0.5, metavar="M", help="SGD momentum")
parser.add_argument("--no-cuda", action="store_true", default=False,
                    help="disables CUDA training")
parser.add_argument("--seed", type=int, default=42, metavar="S", help="random seed")
parser.add_argument("--log-interval", type=int, default=2, metavar="N",
                    help="how many batches to wait before logging training status")
parser.add_argument("--fp16-pushpull", action="store_true", default=False,
                    help="use fp16 compression during pushpull")
parser.add_argument("--log-json", default=None, help="rank 0 writes its losses here")
args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()

# BytePS: initialize library.
bps.init()
torch.manual_seed(args.seed)

if args.cuda:
    # BytePS: pin GPU to local rank.
    torch.cuda.set_device(bps.local_rank())
    torch.cuda.manual_seed(args.seed)


def synthetic_mnist(count, seed):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(count, 1, 28, 28, generator=g)
    labels = (images.mean(dim=(1, 2, 3)) * 40).long().clamp(-5, 4) + 5
    return torch.utils.data.TensorDataset(images, labels)


kwargs = {}
train_dataset = synthetic_mnist(128, seed=1)
# BytePS: use DistributedSampler to partition the training data.
train_sampler = torch.utils.data.distributed.DistributedSampler(
    train_dataset, num_replicas=bps.size(), rank=bps.rank(), shuffle=False)
train_loader = torch.utils.data.DataLoader(
    train_dataset, batch_size=args.batch_size, sampler=train_sampler, **kwargs)

test_dataset = synthetic_mnist(64, seed=2)
# BytePS: use DistributedSampler to partition the test data.
test_sampler = torch.utils.data.distributed.DistributedSampler(
    test_dataset, num_replicas=bps.size(), rank=bps.rank(), shuffle=False)
test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size,
                                          sampler=test_sampler, **kwargs)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.fc1 = nn.Linear(320, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


model = Net()

if args.cuda:
    # Move model to GPU.
    model.cuda()

# BytePS: scale learning rate by the number of GPUs.
optimizer = optim.SGD(model.parameters(), lr=args.lr * bps.size(), momentum=args.momentum)

# BytePS: broadcast parameters.
bps.broadcast_parameters(model.state_dict(), root_rank=0)
bps.broadcast_optimizer_state(optimizer, root_rank=0)

# BytePS: (optional) compression algorithm.
compression = bps.Compression.fp16 if args.fp16_pushpull else bps.Compression.none

# BytePS: wrap optimizer with DistributedOptimizer.
optimizer = bps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression)
record = {"train_loss": [], "test_loss": [], "test_accuracy": []}


def train(epoch):
    model.train()
    # BytePS: set epoch to sampler for shuffling.
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        if args.cuda:
            data, target = data.cuda(), target.cuda()
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        record["train_loss"].append(loss.item())
        if batch_idx % args.log_interval == 0 and bps.rank() == 0:
            # BytePS: use train_sampler to determine the number of examples in
            # this worker's partition.
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)} "
                  f"({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}")


def metric_average(val, name):
    tensor = torch.tensor(val)
    if args.cuda:
        tensor = tensor.cuda()
    avg_tensor = bps.push_pull(tensor, name=name)
    return avg_tensor.item()


def test():
    model.eval()
    test_loss = 0.0
    test_accuracy = 0.0
    with torch.no_grad():
        for data, target in test_loader:
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            output = model(data)
            # sum up batch loss
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            # get the index of the max log-probability
            pred = output.data.max(1, keepdim=True)[1]
            test_accuracy += pred.eq(target.data.view_as(pred)).cpu().float().sum().item()

    # BytePS: use test_sampler to determine the number of examples in
    # this worker's partition.
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)

    # BytePS: average metric values across workers.
    test_loss = metric_average(test_loss, "avg_loss")
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")
    record["test_loss"].append(test_loss)
    record["test_accuracy"].append(test_accuracy)

    # BytePS: print output only on first rank.
    if bps.rank() == 0:
        print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: "
              f"{100.0 * test_accuracy:.2f}%\n")


for epoch in range(1, args.epochs + 1):
    train(epoch)
    test()

if args.log_json and bps.rank() == 0:
    with open(args.log_json, "w") as f:
        json.dump(record, f)
