"""Allocation policies NP, ED, HD and the whole HetPipe plan."""

import pytest
import torch

from polytrain import ConfigError
from polytrain.emulation.devices import homogeneous, parse_cluster
from polytrain.emulation.profile import profile_model
from polytrain.models import GPT
from polytrain.pipeline.allocation import allocate, count_virtual_workers, plan_hetpipe
from polytrain.pipeline.partition import minmax_cut_brute


def indices(vws):
    return [[d.index for d in vw.devices] for vw in vws]


def test_policies_on_four_machines_of_four_types():
    c = parse_cluster("a:fast*4,b:slow*4,c:mid*4,d:fast*4")
    assert indices(allocate(c, "np")) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                          [12, 13, 14, 15]]
    # Within a VW the slowest devices come first (ties in machine order).
    assert indices(allocate(c, "ed")) == [[4, 8, 0, 12], [5, 9, 1, 13], [6, 10, 2, 14],
                                          [7, 11, 3, 15]]
    # hd: fastest machine a with slowest b, then d with c; each pair makes two VWs of halves.
    assert indices(allocate(c, "hd")) == [[4, 5, 0, 1], [6, 7, 2, 3], [8, 9, 12, 13],
                                          [10, 11, 14, 15]]
    for policy in ("np", "ed", "hd"):
        assert count_virtual_workers(16, 4, policy) == len(allocate(c, policy))


def test_hd_makes_virtual_workers_of_even_speed_of_machines_of_mixed_types():
    # Symptom: on "m0:fast*2+slow*2,m1:fast*2+slow*2" hd made one VW of the four fast
    # devices and one of the four slow (4.1 ms per minibatch; np's two mixed VWs 2.6 ms),
    # and on "m0:fast+slow,m1:fast+slow" fast+fast and slow+slow. Cause: each machine's
    # devices were cut in halves by local index, whatever their types.
    c = parse_cluster("m0:fast*2+slow*2,m1:fast*2+slow*2")
    vws = allocate(c, "hd")
    # Each machine's half together (the diff's review: sorted as one, slow, slow, fast, fast,
    # they crossed machines three times: 18.9 ms a minibatch against 10.8 on a slow link).
    assert indices(vws) == [[2, 0, 6, 4], [3, 1, 7, 5]]
    assert [[d.type.name for d in vw.devices] for vw in vws] == [["slow", "fast", "slow",
                                                                  "fast"]] * 2
    assert [[d.machine_index for d in vw.devices] for vw in vws] == [[0, 0, 1, 1]] * 2
    model = GPT(seq_len=16, d_model=32, layers=4, heads=2)
    profile = profile_model(model, torch.zeros(1, 16, dtype=torch.long))
    hd, np_ = (plan_hetpipe(c, profile, policy=policy, global_batch=8, state_factor=2)
               for policy in ("hd", "np"))
    assert hd.pipelines[0].period == pytest.approx(hd.pipelines[1].period)
    assert hd.period < 1.25 * np_.period  # was 1.58x: the slow VW held the fast one back
    # One device of each type per machine: the fast half of one machine goes with the
    # slow half of the other.
    vws = allocate(parse_cluster("m0:fast+slow,m1:fast+slow"), "hd")
    assert indices(vws) == [[3, 0], [1, 2]]
    # An odd one out of each type: dealt fastest first, and the halves of the pair crossed.
    vws = allocate(parse_cluster("m0:fast*3+slow,m1:fast*3+slow"), "hd")
    assert [sorted(d.type.name for d in vw.devices) for vw in vws] == [
        ["fast", "fast", "fast", "slow"]] * 2


def test_hd_on_one_machine_of_mixed_types_runs_its_devices_slowest_first():
    # Symptom: "m0:fast*2+slow*2" under the default hd ran fast -> fast -> slow -> slow (np:
    # slow first), the stale first stages on the fast devices. Cause: hd orders its own VWs,
    # and its one machine's VW was the machine's devices in machine order.
    c = parse_cluster("m0:fast*2+slow*2")
    vws = allocate(c, "hd")
    assert indices(vws) == [[2, 3, 0, 1]] == indices(allocate(c, "np"))
    model = GPT(seq_len=16, d_model=32, layers=4, heads=2)
    profile = profile_model(model, torch.zeros(1, 16, dtype=torch.long))
    hd = plan_hetpipe(c, profile, policy="hd", global_batch=8, state_factor=2, inflight=4)
    assert hd.pipelines[0].devices == ("slow", "slow", "fast", "fast")
    assert "m0/2 slow -> m0/3 slow -> m0/0 fast -> m0/1 fast" in hd.describe()


def test_hd_needs_machines_of_even_size_and_unknown_policies_are_refused():
    with pytest.raises(ConfigError, match="policy 'hd' splits.*hold 3 devices"):
        allocate(parse_cluster("a:fast*3,b:slow*3"), "hd")
    with pytest.raises(ConfigError, match="unknown allocation policy 'xy'; the policies are: "
                                          "np, ed, hd"):
        count_virtual_workers(4, 2, "xy")
    # Machines of different sizes (a library cluster; the CLI makes even ones): IndexError.
    # Its hint then said "or pass --policy np", which every training run refuses too (the
    # launcher, and HetPipe under torchrun, take machines of as many workers only).
    with pytest.raises(ConfigError, match=r"--policy ed takes one device of every machine "
                                          r"for each virtual worker, and the machines hold "
                                          r"\[4, 2\] devices. HINT: give every machine "
                                          r"as many devices \(training starts as many "
                                          r"workers on each, whatever the policy\)$"):
        allocate(parse_cluster("a:fast*4,b:slow*2"), "ed")
    # hd: ValueError: min() arg is an empty sequence (its halves came from one machine's
    # count); and ed's hint named hd, which needs even machines too.
    with pytest.raises(ConfigError, match=r"--policy hd splits the machines' devices in "
                                          r"halves, pairing machines, and the machines hold "
                                          r"\[1, 3\] devices"):
        allocate(parse_cluster("m0:fast*1,m1:slow*3"), "hd")
    assert len(allocate(parse_cluster("m0:fast*1,m1:slow*3"), "np")) == 2


def test_plan_on_two_fast_and_two_slow_devices():
    c = parse_cluster("m0:fast*2,m1:slow*2")
    model = GPT(seq_len=16, d_model=32, layers=8, heads=2)
    profile = profile_model(model, torch.zeros(1, 16, dtype=torch.long))
    ed = plan_hetpipe(c, profile, policy="ed", global_batch=16, state_factor=2)
    assert ed.minibatch == 8 and len(ed.virtual_workers) == 2
    assert ed.roles(2) == [(0, 0)] and ed.roles(1) == [(1, 1)]
    for plan in ed.pipelines:
        assert plan.devices == ("slow", "fast")  # the stale first stage on the slow device
        first, second = plan.stage_layers(0), plan.stage_layers(1)
        assert len(first) < len(second)  # the fast device takes more layers
    np_ = plan_hetpipe(c, profile, policy="np", global_batch=16, state_factor=2)
    assert np_.pipelines[0].devices == ("fast", "fast")
    assert np_.period > ed.period  # the slow VW of NP holds the fast one back under WSP
    text = ed.describe()
    assert "policy ed, 2 virtual workers" in text and "m1/0 slow -> m0/0 fast" in text
    brute = plan_hetpipe(c, profile, policy="ed", global_batch=16, state_factor=2,
                         search=minmax_cut_brute)
    assert brute == ed


def test_one_in_flight_cuts_for_the_least_round_trip():
    # Regression: with --inflight 1 each virtual worker took the cut of the least slowest
    # stage, though with one minibatch in flight a minibatch takes the round trip (the
    # stages' sum): the benchmark's GPT ran embed..h3 | h4..head, 334.8 ms a minibatch by
    # the cost model, where embed | h0..head fits and takes 253.0 ms.
    c = parse_cluster("m0:fast*2,m1:slow*2")
    model = GPT(seq_len=16, d_model=32, layers=8, heads=2)
    profile = profile_model(model, torch.zeros(1, 16, dtype=torch.long))
    one = plan_hetpipe(c, profile, policy="ed", global_batch=16, state_factor=2, inflight=1)
    two = plan_hetpipe(c, profile, policy="ed", global_batch=16, state_factor=2, inflight=2)
    for a, b in zip(one.pipelines, two.pipelines):
        assert a.stage_layers(0) == ("embed",)  # the fast device's time is worth less
        assert a.period == a.round_trip < b.round_trip  # the min-max cut's
        assert b.bottleneck < a.bottleneck  # with 2 in flight the slowest stage binds


def test_one_in_flight_on_even_devices_keeps_the_min_max_cut():
    # On equal devices, with equal activations between layers (GPT's), every cut has the
    # same round trip, summed in another order: a cut a rounding error faster must not
    # replace the balanced one (the plan of a run without --devices would move for nothing).
    profile = profile_model(GPT(), torch.zeros(1, 64, dtype=torch.long))
    c = homogeneous(4, 2)
    one = plan_hetpipe(c, profile, policy="ed", global_batch=32, state_factor=2, inflight=1)
    two = plan_hetpipe(c, profile, policy="ed", global_batch=32, state_factor=2, inflight=2)
    assert [p.bounds for p in one.pipelines] == [p.bounds for p in two.pipelines]


def test_a_model_too_big_for_the_devices_is_refused():
    c = parse_cluster("tiny=4/1,m0:tiny*2,m1:tiny*2")
    profile = profile_model(GPT(), torch.zeros(1, 64, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"does not fit virtual worker 0 .*MiB on stage .* of "
                                          r"device type tiny with 1 MiB"):
        plan_hetpipe(c, profile, policy="ed", global_batch=8, state_factor=2)


def test_an_inflight_too_many_for_memory_is_refused_with_the_largest_that_fits():
    # Symptom: --inflight 4 on devices of 1.5 MiB was refused with a hint of devices, batch
    # and optimizer only, though N_m = 2 fits (the partitioner's own choice without it).
    # Cause: the refusal was the first virtual worker's at the N_m given, whatever fits.
    c = parse_cluster("tiny=4/1.5,m0:tiny*2,m1:tiny*2")
    profile = profile_model(GPT(seq_len=16, d_model=32), torch.zeros(1, 16, dtype=torch.long))
    assert plan_hetpipe(c, profile, policy="hd", global_batch=8, state_factor=2,
                        inflight=2).inflight == 2
    with pytest.raises(ConfigError) as refused:
        plan_hetpipe(c, profile, policy="hd", global_batch=8, state_factor=2, inflight=4)
    assert str(refused.value) == (
        "the model does not fit virtual worker 0 (m0/0 tiny, m1/0 tiny)'s memory: with N_m = 4 "
        "in flight and minibatch 4, the cut that needs the least memory still needs 2.3 MiB "
        "on stage 1 (layers h2, h3, head) of device type tiny with 1.5 MiB. HINT: pass a "
        "smaller --inflight (the largest N_m that fits is 2), or use devices with more "
        "memory, more devices per virtual worker, a smaller --batch-size, or SGD instead of "
        "Adam")
    # Where N_m = 1 does not fit either, there is no smaller one to offer.
    with pytest.raises(ConfigError, match=r"HINT: use devices with more memory"):
        plan_hetpipe(parse_cluster("tiny=4/0.5,m0:tiny*2,m1:tiny*2"), profile, policy="hd",
                     global_batch=8, state_factor=2, inflight=4)


def test_bd_pairs_each_virtual_worker_with_a_twin_running_the_other_way():
    c = parse_cluster("m0:fast*2,m1:slow*2")
    vws = allocate(c, "bd")
    # ED's virtual workers (slowest first), each followed by its twin in reverse.
    assert indices(vws) == [[2, 0], [0, 2], [3, 1], [1, 3]]
    assert count_virtual_workers(4, 2, "bd") == 4
    model = GPT(seq_len=16, d_model=32, layers=8, heads=2)
    profile = profile_model(model, torch.zeros(1, 16, dtype=torch.long))
    bd = plan_hetpipe(c, profile, policy="bd", global_batch=16, state_factor=2)
    assert bd.inflight == 1 and bd.minibatch == 4
    # Every device runs a stage of two virtual workers: stage 0 of one, stage 1 of its twin.
    assert bd.roles(0) == [(0, 1), (1, 0)] and bd.roles(2) == [(0, 0), (1, 1)]
    down, up = bd.pipelines[0], bd.pipelines[1]
    assert down.devices == ("slow", "fast") and up.devices == ("fast", "slow")
    # Each cut balances its own stages, so each device does the same work per round: the
    # slow one a third of the model twice (first layers of one, last layers of the other).
    assert len(down.stage_layers(0)) < len(down.stage_layers(1))
    assert len(up.stage_layers(0)) > len(up.stage_layers(1))
    slow = down.stage_times[0] + up.stage_times[1]
    fast = down.stage_times[1] + up.stage_times[0]
    assert abs(slow - fast) / max(slow, fast) < 0.15
    # A device's two stages share its memory: each gets half.
    assert all(limit == 512 * 2**20 for p in bd.pipelines for limit in p.memory_limits)


def test_bd_is_refused_with_many_in_flight_or_not_two_machines():
    c = parse_cluster("m0:fast*2,m1:slow*2")
    model = GPT(seq_len=16, d_model=32, layers=4, heads=2)
    profile = profile_model(model, torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(ConfigError, match="policy 'bd' keeps one minibatch in flight"):
        plan_hetpipe(c, profile, policy="bd", global_batch=16, state_factor=2, inflight=2)
    with pytest.raises(ConfigError, match="policy 'bd' pairs the devices of two machines.*3"):
        allocate(parse_cluster("a:fast,b:slow,c:mid"), "bd")
