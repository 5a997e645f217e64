"""Fixed freeze schedules on PipeTransformer's fine-tuning task, in one process: loss only.

What AutoFreeze could at best keep: the benchmark's task (``pipetransformer.py``: the
same pre-trained GPT, ``text-finetune`` in epochs, Adam 1e-3, batch 32, held-out
evaluation) trained in a plain loop, freezing the front ``F`` layers from step ``S``
for each schedule ``S:F,S:F,...`` (``none``: no freezing). A frozen layer gets no
gradient and no update, as in the strategy. Prints each schedule's final and best
held-out loss; saves ``benchmarks/results/freeze_schedules.json``.

    ./dev bench freeze_schedules --pretrain-steps 2400 --steps 240 \\
        --schedules none 20:3,40:5,60:7,80:8 20:8 40:3
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from pipetransformer import pretrained  # benchmarks/pipetransformer.py (this folder)

from polytrain.data import EVAL_SAMPLES, EpochBatches, get_dataset, held_out_split, windows
from polytrain.emulation.profile import layers_of
from polytrain.models import get_model
from polytrain.train.loop import evaluate

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = {"seq_len": 32, "d_model": 64, "layers": 8, "heads": 4}


def parse(schedule: str) -> dict[int, int]:
    """``"20:3,40:5"`` -> {20: 3, 40: 5} (step -> front layers frozen from it)."""
    if schedule == "none":
        return {}
    return {int(s): int(f) for s, f in (part.split(":") for part in schedule.split(","))}


def fine_tune(init: Path, schedule: dict[int, int], *, steps: int, eval_every: int,
              lr: float) -> list[float]:
    """Held-out loss every ``eval_every`` steps of fine-tuning ``init`` under ``schedule``."""
    spec = get_model("gpt")
    corpus, rest = held_out_split(get_dataset("text-finetune"))
    held = spec.split(windows(rest, MODEL["seq_len"] + 1, limit=EVAL_SAMPLES))
    torch.manual_seed(0)
    net = spec.make(**MODEL)
    net.load_state_dict(torch.load(init, weights_only=True))
    names = [n for n, _ in layers_of(net)]
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    batches = EpochBatches(corpus, batch_size=32, window=MODEL["seq_len"] + 1, seed=0)
    losses = []
    for step, batch in zip(range(steps), batches.iterate()):
        if step in schedule:
            frozen = set(names[:schedule[step]])
            for name, p in net.named_parameters():
                if name.split(".", 1)[0] in frozen:
                    p.requires_grad_(False)
                    p.grad = None
        x, y = spec.split(batch)
        opt.zero_grad(set_to_none=True)
        spec.loss(net(x), y).backward()
        opt.step()
        if (step + 1) % eval_every == 0:
            losses.append(evaluate(net, *held, spec.loss, device=torch.device("cpu"))[0])
    return losses


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pretrain-steps", type=int, default=2400,
                   help="the pre-trained model's steps (made here if missing, as "
                        "pipetransformer.py makes it)")
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--schedules", nargs="+", default=["none", "20:3,40:5,60:7,80:8"])
    p.add_argument("--out", type=Path, default=RESULTS / "freeze_schedules.json")
    args = p.parse_args(argv)
    tag = "-".join(f"{k}{v}" for k, v in MODEL.items())
    folder = RESULTS / f"pretrained-{tag}-{args.pretrain_steps}"
    # The benchmark's own pre-training: made here if missing (it was a hint to run the whole
    # benchmark, which overwrote its results), made again if another machine made it.
    pretrained(folder, MODEL, args.pretrain_steps)
    init = folder / "final.pt"
    runs = {}
    for s in args.schedules:
        losses = fine_tune(init, parse(s), steps=args.steps, eval_every=args.eval_every,
                           lr=args.lr)
        runs[s] = {"final": losses[-1], "best": min(losses), "eval": losses}
        print(f"{s:28s} final {losses[-1]:.4f} best {min(losses):.4f}", flush=True)
    args.out.write_text(json.dumps({"pretrain_steps": args.pretrain_steps, "steps": args.steps,
                                    "eval_every": args.eval_every, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
