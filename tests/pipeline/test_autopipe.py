"""AutoPipe and AutoDP's plans alone: cuts, halving, replicas, micro-batches (pure data)."""

import pytest
import torch

from polytrain import ConfigError
from polytrain.emulation.profile import profile_model
from polytrain.models import GPT
from polytrain.pipeline.autopipe import choose_microbatches, plan_pipe


@pytest.fixture(scope="module")
def profile():
    return profile_model(GPT(seq_len=16, d_model=32, layers=6), torch.zeros(1, 16,
                                                                            dtype=torch.long))


def test_the_first_plan_cuts_every_layer_over_the_stages_asked_for(profile):
    plan = plan_pipe(profile, step=0, frozen=0, stages=4, replicas=2, global_batch=32)
    assert (plan.stages, plan.replicas, plan.micro_batches) == (4, 2, 8)
    assert plan.bounds == (0, 2, 4, 6, 8)  # embed h0 | h1 h2 | h3 h4 | h5 head
    assert [plan.pipeline_of(w) for w in (0, 3, 4, 7)] == [(0, 0), (0, 3), (1, 0), (1, 3)]
    assert plan.workers_of_stage(1) == [1, 5]


def test_frozen_layers_move_to_the_first_stage_at_their_forward_cost(profile):
    first = plan_pipe(profile, step=0, frozen=0, stages=4, replicas=2, global_batch=32)
    plan = plan_pipe(profile, step=10, frozen=2, stages=4, replicas=2, global_batch=32,
                     previous=first, autodp=False, memory=1.0 * 2**20)
    assert plan.bounds[0] == 2 and plan.frozen_layers == ("embed", "h0")
    layers = profile.layers
    front = layers[0].fwd_flops + layers[1].fwd_flops
    assert plan.stage_cost[0] == pytest.approx(
        front + sum(x.flops for x in layers[2:plan.bounds[1]]))


def test_the_frozen_front_costs_its_forward_on_the_share_the_cache_will_not_serve(profile):
    first = plan_pipe(profile, step=0, frozen=0, stages=4, replicas=2, global_batch=32)
    layers = profile.layers
    front = layers[0].fwd_flops + layers[1].fwd_flops
    costs = {}
    for cached in (0.0, 0.25, 1.0):
        plan = plan_pipe(profile, step=10, frozen=2, stages=4, replicas=2, global_batch=32,
                         previous=first, autodp=False, cached=cached, memory=1.0 * 2**20)
        costs[cached] = plan.stage_cost[0] - sum(x.flops for x in layers[2:plan.bounds[1]])
    assert costs == pytest.approx({0.0: front, 0.25: 0.75 * front, 1.0: 0.0})
    # As a function of the candidate: the share depends on which stages hold the caches.
    asked = []

    def share(frozen, stages, replicas):
        asked.append((frozen, stages, replicas))
        return 0.25

    plan = plan_pipe(profile, step=10, frozen=2, stages=4, replicas=2, global_batch=32,
                     previous=first, autodp=False, cached=share, memory=1.0 * 2**20)
    assert plan.stage_cost[0] - sum(x.flops for x in layers[2:plan.bounds[1]]) == \
        pytest.approx(0.75 * front)
    assert (2, 4, 2) in asked and {f for f, _, _ in asked} == {2}


def test_the_pipeline_halves_and_replicas_double_when_half_the_stages_hold_it(profile):
    first = plan_pipe(profile, step=0, frozen=0, stages=4, replicas=2, global_batch=32,
                      memory=1.0 * 2**20)
    plan = plan_pipe(profile, step=10, frozen=2, stages=4, replicas=2, global_batch=32,
                     previous=first, memory=1.0 * 2**20)
    assert (plan.stages, plan.replicas, plan.micro_batches) == (2, 4, 4)
    # Per step the slowest stage is no slower: cost per sample x the replica's batch.
    assert plan.bottleneck * 32 / plan.replicas <= first.bottleneck * 32 / first.replicas
    # Without AutoDP a replica keeps its batch, so half the stages would be slower...
    alone = plan_pipe(profile, step=10, frozen=2, stages=4, replicas=2, global_batch=32,
                      previous=first, memory=1.0 * 2**20, autodp=False)
    assert (alone.stages, alone.replicas) == (4, 2)
    # ...until fewer layers train than there are stages; then the freed workers idle.
    short = plan_pipe(profile, step=10, frozen=5, stages=4, replicas=2, global_batch=32,
                      previous=first, memory=1.0 * 2**20, autodp=False)
    assert (short.stages, short.replicas) == (2, 2) and short.pipeline_of(3) == (1, 1)
    assert short.pipeline_of(4) is None and short.pipeline_of(7) is None
    # The memory of one device decides how short the pipeline can get.
    roomy = plan_pipe(profile, step=10, frozen=2, stages=4, replicas=2, global_batch=32,
                      previous=first)
    assert (roomy.stages, roomy.replicas) == (1, 8)
    # A global batch that does not split over twice the replicas keeps the pipeline.
    odd = plan_pipe(profile, step=10, frozen=2, stages=4, replicas=2, global_batch=34,
                    previous=plan_pipe(profile, step=0, frozen=0, stages=4, replicas=2,
                                       global_batch=34))
    assert (odd.stages, odd.replicas) == (4, 2)


def test_a_pipeline_that_cannot_halve_far_enough_freezes_fewer_layers(profile):
    # AutoFreeze may freeze all but the last layer, and a pipeline of 3 stages (odd), or
    # one whose batch does not split over twice the replicas, could not shrink below its
    # trained layers: the run stopped at a freeze point, on every worker (a review found it).
    first = plan_pipe(profile, step=0, frozen=0, stages=3, replicas=1, global_batch=12)
    odd = plan_pipe(profile, step=10, frozen=7, stages=3, replicas=1, global_batch=12,
                    previous=first)
    assert (odd.frozen, odd.stages) == (5, 3)  # 8 layers: 3 train, one a stage
    first = plan_pipe(profile, step=0, frozen=0, stages=4, replicas=1, global_batch=2)
    short = plan_pipe(profile, step=10, frozen=7, stages=4, replicas=1, global_batch=2,
                      previous=first)
    assert (short.frozen, short.stages, short.replicas) == (6, 2, 2)
    # Never fewer than before.
    again = plan_pipe(profile, step=20, frozen=7, stages=2, replicas=2, global_batch=2,
                      previous=short)
    assert again.frozen == 6


def test_freeze_only_keeps_the_cuts(profile):
    first = plan_pipe(profile, step=0, frozen=0, stages=4, replicas=2, global_batch=32)
    plan = plan_pipe(profile, step=10, frozen=3, stages=4, replicas=2, global_batch=32,
                     previous=first, autopipe=False)
    assert plan.bounds == first.bounds and (plan.stages, plan.replicas) == (4, 2)
    assert plan.stage_cost[0] < first.stage_cost[0]  # embed and h0 skip their backward


def test_a_model_that_fits_no_cut_is_refused(profile):
    with pytest.raises(ConfigError, match="fits a device's 0.1 MiB"):
        plan_pipe(profile, step=0, frozen=0, stages=4, replicas=2, global_batch=32,
                  memory=0.1 * 2**20)


def test_micro_batches_fill_the_bubble():
    assert choose_microbatches(1, 16) == 1
    assert choose_microbatches(2, 16) == 4
    assert choose_microbatches(4, 12) == 12
    assert choose_microbatches(4, 6) == 6


def test_a_frozen_front_stage_0_cannot_hold_freezes_fewer_layers_not_the_run():
    # Stage 0 holds the whole frozen front (its weights once); at 5 frozen layers no cut
    # fitted any K the pipeline could halve to, and the run stopped mid-training with
    # '3 trained layers cannot fill 1 stages' (memory was the limit, not the layers).
    from polytrain.emulation.profile import LayerProfile, ModelProfile
    layer = [LayerProfile(f"l{i}", 1e6, 2e6, 100, 0.0, 4.0, (1,), torch.float32)
             for i in range(8)]  # 100 bytes of weights: 400 trained (SGD-like state 2)
    profile = ModelProfile(tuple(layer), (1,), torch.long)
    plan = plan_pipe(profile, step=0, frozen=0, stages=4, replicas=2, global_batch=32,
                     memory=850)
    for asked, frozen in ((3, 3), (5, 4)):
        plan = plan_pipe(profile, step=10, frozen=asked, stages=plan.stages,
                         replicas=plan.replicas, global_batch=32, previous=plan, memory=850)
        assert plan.frozen == frozen
    assert plan.bounds == (4, 5, 6, 7, 8)
    with pytest.raises(ConfigError, match=r"no cut of the 4 trained layers into 4 stages or "
                                          r"fewer fits a device's"):
        plan_pipe(profile, step=20, frozen=5, stages=plan.stages, replicas=plan.replicas,
                  global_batch=32, previous=plan, memory=700)
