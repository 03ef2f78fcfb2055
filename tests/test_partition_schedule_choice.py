"""Ranking the schedules the runtime runs for a plan (partitioner/schedule_choice.py, ``--schedule``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from partitioner import partition
from partitioner.cli import main
from partitioner.plan import PlanError, load_plan
from pipedream_ft.config import planned_schedule
from partitioner.schedule_choice import choose, rank_schedules, schedule_costs
from profiler.profile import Layer, Profile

pytestmark = pytest.mark.timeout(60)

P, A = 1e6, 1e5  # parameter and activation bytes of each layer


def _profile(layers: int = 8, forward: float = 1.0, backward: float = 2.0) -> Profile:
    return Profile(tuple(Layer(str(i), "Linear", forward, backward, A, P) for i in range(layers)),
                   tuple((i, i + 1) for i in range(layers - 1)))


def _by_name(ranking):
    return {r.name: r for r in ranking}


def test_balanced_stages_rank_as_the_textbook_formulas_say():
    profile = _profile()
    plan = partition(profile, 4, 1e12, straight=True)
    assert [len(s.layers) for s in plan.stages] == [2, 2, 2, 2]
    m, S, F, B = 8, 4, 2.0, 4.0  # per stage: 2 layers of 1 ms forward, 2 ms backward
    got = _by_name(rank_schedules(plan, profile, m))
    assert got["1f1b"].time_per_minibatch_s == pytest.approx((m + S - 1) * (F + B) / m / 1e3)
    assert got["gpipe"].time_per_minibatch_s == pytest.approx((m + S - 1) * (F + B) / m / 1e3)
    # ZB-H1: the bubble shrinks to (S - 1)(F + I - W), I = W = B / 2
    assert got["zb_h1"].time_per_minibatch_s == pytest.approx((m * (F + B) + (S - 1) * F) / m / 1e3)
    assert got["pipedream"].time_per_minibatch_s == pytest.approx((F + B) / 1e3)
    assert got["1f1b"].bubble == pytest.approx((S - 1) / (m + S - 1))
    # memory as each holds it: GPipe every minibatch of the step, 1F1B S - s, PipeDream a stash per minibatch too
    assert got["gpipe"].memory_bytes == pytest.approx([2 * P + m * 2 * A] * S)
    assert got["1f1b"].memory_bytes == pytest.approx([2 * P + (S - s) * 2 * A for s in range(S)])
    assert got["pipedream"].memory_bytes == pytest.approx([(S - s) * 2 * (P + A) for s in range(S)])
    # ZB-H1: a stage's deferred W keep their activations, S minibatches on every stage: 1F1B's peak
    assert got["zb_h1"].memory_bytes == pytest.approx([2 * P + S * 2 * A] * S)
    ranking = rank_schedules(plan, profile, m)
    assert choose(ranking).name == "zb_h1"  # synchronous only, by default
    assert choose(ranking, synchronous=False).name == "pipedream"


def test_the_costs_the_ranking_simulates_are_public_and_sum_each_stages_layers():
    """``schedule_costs``: per stage, the layers' forwards and their backwards split into I and W (seconds), the
    costs the ranking's simulation runs on."""
    from pipedream_ft.schedules import build, simulate

    measured = Profile(tuple(Layer(str(i), "Linear", 1.0, 2.0, A, P, weight_backward_ms=0.5 * (i % 2))
                             for i in range(8)), _profile().edges)
    plan = partition(measured, 4, 1e12, straight=True)
    costs = schedule_costs(plan, measured)
    assert costs.forward == pytest.approx([2e-3] * 4)
    assert costs.weight_backward == pytest.approx([0.5e-3] * 4)
    assert costs.input_backward == pytest.approx([3.5e-3] * 4)
    assert schedule_costs(plan, measured, weight_fraction=0.25).weight_backward == pytest.approx([1e-3] * 4)
    for name in ("1f1b", "zb_h1"):
        step = simulate(build(name, 4, 8).schedule, costs).step_time
        assert _by_name(rank_schedules(plan, measured, 8))[name].time_per_minibatch_s == pytest.approx(step / 8)
    with pytest.raises(PlanError, match="weight_fraction must be in"):
        schedule_costs(plan, measured, weight_fraction=1.5)


def test_a_measured_machine_adds_the_runtimes_own_costs_to_the_simulation(tmp_path: Path, capsys):
    """With ``pipedream-probe``'s machine: half its fixed cost per minibatch per stage on every compute action, and
    between stages the link's latency plus the boundary's bytes over its bandwidth (the level the two stages'
    ranks share); a machine that measured nothing predicts what no machine does."""
    from partitioner.machine import MachineLevel, MachineProfile, zero_machine

    profile = _profile()
    plan = partition(profile, 4, 1e12, straight=True)
    m, S, F, B, O = 8, 4, 2e-3, 4e-3, 1e-3
    assert _by_name(rank_schedules(plan, profile, m, machine=zero_machine([4], [1e300]))) == \
        _by_name(rank_schedules(plan, profile, m))
    machine = MachineProfile((MachineLevel(2, 1e-4, 1e9), MachineLevel(2, 1e-3, 1e8)), overhead_s=O)
    costs = schedule_costs(plan, profile, machine=machine)
    assert costs.overhead == pytest.approx(O / 2)
    # ranks 0|1 and 2|3 share the inner level, 1|2 only the outer one; each boundary carries one layer's A
    assert costs.latency == pytest.approx((2 * (1e-4 + A / 1e9) + (1e-3 + A / 1e8)) / 3)
    got = _by_name(rank_schedules(plan, profile, m, machine=MachineProfile((MachineLevel(4, 0.0, 1e300),),
                                                                          overhead_s=O)))
    assert got["1f1b"].time_per_minibatch_s == pytest.approx((m + S - 1) * (F + B + O) / m)
    assert got["pipedream"].time_per_minibatch_s == pytest.approx(F + B + O)
    # a split backward is one action more per minibatch: ZB-H1 pays o more for each of its m W's
    no_machine = _by_name(rank_schedules(plan, profile, m))["zb_h1"].time_per_minibatch_s
    assert got["zb_h1"].time_per_minibatch_s > no_machine + (m + S - 1) * O / m
    # the command line ranks with the machine it plans for
    prof, probe = tmp_path / "prof.json", tmp_path / "machine.json"
    profile.save(prof)
    MachineProfile((MachineLevel(4, 0.0, 1e300),), overhead_s=O).save(probe)
    assert main([str(prof), "--machine", str(probe), "--straight", "--schedule", "1f1b", "--microbatches", "8",
                 "-o", str(tmp_path / "plan.json")]) == 0
    record = json.loads((tmp_path / "plan.json").read_text())["settings"]["schedule"]
    assert record["machine"] is True
    ranked = {r["name"]: r["time_per_minibatch_s"] for r in record["ranking"]}
    assert ranked["1f1b"] == pytest.approx((m + S - 1) * (F + B + O) / m)
    assert "and the machine's: 1.000 ms fixed cost per minibatch per stage" in capsys.readouterr().out


def test_a_memory_limit_rules_schedules_out_and_none_fitting_names_the_least_needed():
    profile = _profile()
    plan = partition(profile, 4, 1e12, straight=True)
    free = _by_name(rank_schedules(plan, profile, 8))
    limit = free["1f1b"].peak_memory_bytes  # 1F1B and ZB-H1 fit exactly; GPipe and PipeDream's stash hold more
    ranking = rank_schedules(plan, profile, 8, memory_bytes=limit)
    fits = {r.name: r.fits for r in ranking}
    assert fits == {"1f1b": True, "zb_h1": True, "gpipe": False, "pipedream": False}
    assert choose(ranking).name == "zb_h1"
    assert choose(ranking, synchronous=False).name == "zb_h1"
    assert [r.name for r in ranking][-2:] in (["gpipe", "pipedream"], ["pipedream", "gpipe"])  # misfits last
    with pytest.raises(PlanError, match=r"no schedule fits the memory limit: the least needs 2\.8e\+06 bytes per "
                                        r"worker \((zb_h1|1f1b)\)"):
        choose(rank_schedules(plan, profile, 8, memory_bytes=1e5))


def test_a_replicated_plan_ranks_what_it_can_run_and_refuses_the_rest():
    profile = _profile(2, forward=1.0, backward=1.0)
    plan = partition(profile, 4, 1e12)  # 2 layers on 4 workers: replicated
    assert any(s.replicas > 1 for s in plan.stages), plan
    assert {r.name for r in rank_schedules(plan, profile, 8)} == {"1f1b", "pipedream"}
    with pytest.raises(PlanError, match="'gpipe' cannot run this plan; a plan with replicated stages runs 1f1b"):
        rank_schedules(plan, profile, 8, names=["gpipe"])
    with pytest.raises(PlanError, match="the runtime runs 1f1b, gpipe, zb_h1, pipedream"):
        rank_schedules(plan, profile, 8, names=["zbv"])


def test_the_command_line_records_the_choice_and_says_how_to_train_with_it(tmp_path: Path, capsys):
    prof, out = tmp_path / "prof.json", tmp_path / "plan.json"
    _profile().save(prof)
    assert main([str(prof), "-n", "4", "-b", "1e12", "--straight", "--schedule", "auto", "--microbatches", "8",
                 "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "train with PipelineConfig(mode='flush', schedule='zb_h1', flush_every=8)" in text
    assert "pipedream (async)" in text
    record = json.loads(out.read_text())["settings"]["schedule"]
    assert record["name"] == "zb_h1" and record["microbatches"] == 8
    assert [r["name"] for r in record["ranking"]] == ["pipedream", "zb_h1", "1f1b", "gpipe"]
    assert main([str(prof), "-n", "2", "-b", "1e12", "--straight", "--schedule", "dualpipev", "--virtual-stages",
                 "3", "--microbatches", "8", "-o", str(tmp_path / "x.json")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == ["pipedream-partition: error: schedule 'dualpipev' cannot run 3 stages per worker with 8 "
                   "minibatches per step"]
    assert not (tmp_path / "x.json").exists()


def test_a_schedule_of_virtual_stages_writes_the_plan_of_workers_times_v_stages(tmp_path: Path, capsys):
    prof, out = tmp_path / "p.json", tmp_path / "plan.json"
    _profile(16).save(str(prof))
    assert main([str(prof), "-n", "4", "-b", "1e12", "--straight", "--schedule", "looped_bfs", "--microbatches",
                 "8", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert ("train with PipelineConfig(mode='flush', schedule='looped_bfs', flush_every=8) on 4 processes (2 of the "
            "plan's 8 stages each)") in text
    plan = load_plan(out)
    assert plan.num_stages == 8 and plan.world_size == 8
    assert plan.stage_to_ranks == partition(_profile(16), 8, 1e12, straight=True).stage_to_ranks
    record = plan.settings["schedule"]
    assert (record["name"], record["workers"], record["stages_per_worker"]) == ("looped_bfs", 4, 2)
    assert planned_schedule("plan", plan.settings) == "looped_bfs"  # what PipelineConfig(schedule="plan") runs


def test_the_backward_split_is_the_profiles_where_measured_and_the_fraction_where_not(tmp_path: Path, capsys):
    measured = Profile(tuple(Layer(str(i), "Linear", 1.0, 2.0, A, P, weight_backward_ms=0.5) for i in range(8)),
                       _profile().edges)
    plan = partition(measured, 4, 1e12, straight=True)
    unsplit = _profile()
    zb = {w: _by_name(rank_schedules(plan, unsplit, 8, weight_fraction=w))["zb_h1"].time_per_minibatch_s
          for w in (0.25, 0.5)}
    assert zb[0.25] > zb[0.5]  # less weight gradient to fill the bubble with
    assert _by_name(rank_schedules(plan, measured, 8))["zb_h1"].time_per_minibatch_s == pytest.approx(zb[0.25])
    assert _by_name(rank_schedules(plan, unsplit, 8))["zb_h1"].time_per_minibatch_s == pytest.approx(zb[0.5])
    # given explicitly, the fraction splits every layer, measured or not
    assert _by_name(rank_schedules(plan, measured, 8, weight_fraction=0.5))["zb_h1"].time_per_minibatch_s == \
        pytest.approx(zb[0.5])
    # 1F1B runs whole backwards: the split does not change it
    assert _by_name(rank_schedules(plan, measured, 8))["1f1b"].time_per_minibatch_s == \
        pytest.approx(_by_name(rank_schedules(plan, unsplit, 8))["1f1b"].time_per_minibatch_s)
    half = Profile(measured.layers[:4] + unsplit.layers[4:], measured.edges)
    for profile, said, recorded in [(measured, "backwards split as measured", "measured"),
                                    (unsplit, "backwards split 0.5 weight gradient", 0.5),
                                    (half, "backwards split as measured, 0.5 where not", "measured, 0.5 where not")]:
        profile.save(tmp_path / "prof.json")
        assert main([str(tmp_path / "prof.json"), "-n", "4", "-b", "1e12", "--straight", "--schedule", "zb_h1",
                     "--microbatches", "8", "-o", str(tmp_path / "plan.json")]) == 0
        assert said in capsys.readouterr().out
        assert json.loads((tmp_path / "plan.json").read_text())["settings"]["schedule"]["weight_fraction"] == recorded


def test_virtual_stages_are_planned_and_simulated_and_chosen_when_fastest():
    """Interleaved 1F1B with v stages per worker: bubble (W - 1)(F + B) / v per step, the textbook's; each
    worker holds the weights of its v stages and, at worst, the activations its own actions keep."""
    from partitioner.schedule_choice import rank_virtual

    profile = _profile(16)
    W, v, m = 4, 2, 8
    got = _by_name(rank_virtual(profile, W, m, 1e12, stages_per_worker=v))
    assert set(got) == {"interleaved_1f1b", "interleaved_zero_bubble", "looped_bfs", "zbv", "dualpipev"}
    F, B = 2.0, 4.0  # per worker-stage: 2 layers; a worker runs 4 layers of a minibatch: 12 ms
    assert got["interleaved_1f1b"].time_per_minibatch_s == pytest.approx(
        (m * v * (F + B) + (W - 1) * (F + B)) / m / 1e3)
    plain = _by_name(rank_schedules(partition(profile, W, 1e12, straight=True), profile, m))
    assert got["interleaved_1f1b"].time_per_minibatch_s < plain["1f1b"].time_per_minibatch_s
    assert all(r.stages_per_worker == v and len(r.memory_bytes) == W for r in got.values())
    assert all(min(r.memory_bytes) >= 4 * P for r in got.values())  # the weights of both its stages
    # looped BFS runs every forward of a stage before its backwards: worker 0 holds all m of stage 0 and stage 4
    assert got["looped_bfs"].memory_bytes[0] == pytest.approx(4 * P + 2 * m * 2 * A)
    ranking = rank_schedules(partition(profile, W, 1e12, straight=True), profile, m) + list(got.values())
    fastest = min((r for r in ranking if r.name != "pipedream"), key=lambda r: r.time_per_minibatch_s)
    assert choose(ranking) == fastest and fastest.stages_per_worker == v  # interleaving pays here
    with pytest.raises(PlanError, match="no schedule to choose from"):
        choose([r for r in ranking if r.name == "pipedream"])
    three = _by_name(rank_virtual(profile, W, m, 1e12, stages_per_worker=3))
    assert set(three) == {"interleaved_1f1b", "interleaved_zero_bubble", "looped_bfs"}  # the V ones need 2
    assert "dualpipev" not in _by_name(rank_virtual(profile, W, 4, 1e12))  # fewer microbatches than stages
    with pytest.raises(PlanError, match="unknown schedules of virtual stages \\['1f1b'\\]"):
        rank_virtual(profile, W, m, 1e12, names=["1f1b"])
    with pytest.raises(PlanError, match="4 workers x 8 stages"):
        rank_virtual(_profile(8), W, m, 1e12, stages_per_worker=8)


def test_virtual_stages_pay_the_machines_fixed_cost_per_action_of_every_stage(tmp_path: Path, capsys):
    """With a measured machine, each of a worker's stages pays the fixed cost on each of its actions (interleaving
    v stages multiplies the actions per minibatch by v), and two stages on one worker exchange nothing."""
    from partitioner.machine import MachineLevel, MachineProfile
    from partitioner.schedule_choice import rank_virtual
    from pipedream_ft.schedules import build, simulate

    profile = _profile(16)
    W, v, m, O = 4, 2, 8, 2e-3
    machine = MachineProfile((MachineLevel(W, 1e-4, 1e300),), overhead_s=O)
    free = _by_name(rank_virtual(profile, W, m, 1e12, stages_per_worker=v))
    paid = _by_name(rank_virtual(profile, W, m, 1e12, stages_per_worker=v, machine=machine))
    plan = partition(profile, W * v, 1e12, straight=True)
    for name in ("interleaved_1f1b", "zbv"):
        built = build(name, W, m, v if name == "interleaved_1f1b" else None)
        costs = schedule_costs(plan, profile, machine=machine)
        # every boundary of interleaving crosses workers; ZBV's middle one (stages 3 | 4) stays on worker 3
        crossing = sum(built.placement[s] != built.placement[s + 1] for s in range(W * v - 1))
        assert crossing == (W * v - 1 if name == "interleaved_1f1b" else W * v - 2)
        expected = simulate(built.schedule, dataclasses.replace(costs, latency=1e-4), built.placement)
        assert paid[name].time_per_minibatch_s == pytest.approx(expected.step_time / m)
        assert paid[name].time_per_minibatch_s > free[name].time_per_minibatch_s + v * O
    # the command line takes --virtual-stages with --machine
    prof, probe, out = tmp_path / "p.json", tmp_path / "machine.json", tmp_path / "plan.json"
    profile.save(str(prof))
    machine.save(probe)
    assert main([str(prof), "--machine", str(probe), "--straight", "--schedule", "auto", "--virtual-stages", "2",
                 "--microbatches", "8", "-o", str(out)]) == 0
    record = json.loads(out.read_text())["settings"]["schedule"]
    ranked = {r["name"]: r["time_per_minibatch_s"] for r in record["ranking"]}
    assert ranked["interleaved_1f1b"] == pytest.approx(paid["interleaved_1f1b"].time_per_minibatch_s)
    capsys.readouterr()


def test_the_command_line_ranks_virtual_stages_beside_the_others(tmp_path: Path, capsys):
    prof = tmp_path / "p.json"
    _profile(16).save(str(prof))
    out = tmp_path / "plan.json"
    assert main([str(prof), "--workers", "4", "--bandwidth", "1e12", "--straight", "--schedule", "auto",
                 "--virtual-stages", "2", "--microbatches", "8", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "interleaved_1f1b (2 stages/process)" in text and "paper only" not in text
    record = json.loads(out.read_text())["settings"]["schedule"]
    virtual = [r for r in record["ranking"] if r["stages_per_worker"] > 1]
    fastest = min((r for r in record["ranking"] if r["name"] != "pipedream"), key=lambda r: r["time_per_minibatch_s"])
    assert record["name"] == fastest["name"] and len(load_plan(out).stages) == 4 * fastest["stages_per_worker"]
    assert {r["name"] for r in virtual} == {"interleaved_1f1b", "interleaved_zero_bubble", "looped_bfs", "zbv",
                                            "dualpipev"}
    assert all(r["stages_per_worker"] == 2 for r in virtual)
    assert main([str(prof), "--workers", "4", "--bandwidth", "1e12", "--virtual-stages", "2", "-o",
                 str(out)]) == 2
    assert "--virtual-stages needs --schedule" in capsys.readouterr().err


def test_a_table_is_ranked_beside_the_built_ins_and_chosen(tmp_path: Path, capsys):
    from pipedream_ft.schedules import WindowSchedule, build, save_csv

    profile = _profile()
    plan = partition(profile, 4, 1e12, straight=True)
    table = tmp_path / "zb.csv"
    save_csv(build("zb_h1", 4, 8).schedule, table)
    got = _by_name(rank_schedules(plan, profile, 8, tables=[WindowSchedule.load(table)]))
    assert got[str(table)].time_per_minibatch_s == pytest.approx(got["zb_h1"].time_per_minibatch_s)  # it is ZB-H1
    assert got[str(table)].memory_bytes == got["zb_h1"].memory_bytes
    with pytest.raises(PlanError, match="runs windows of 8 minibatches, not 4"):
        rank_schedules(plan, profile, 4, tables=[WindowSchedule.load(table)])
    small = _profile(2, forward=1.0, backward=1.0)
    replicated = partition(small, 4, 1e12)  # 2 layers on 4 workers
    two = tmp_path / "two.csv"
    save_csv(build("gpipe", len(replicated.stages), 8).schedule, two)
    with pytest.raises(PlanError, match=r"runs a straight pipeline; the plan replicates stages \[0"):
        rank_schedules(replicated, small, 8, tables=[WindowSchedule.load(two)])

    prof, out = tmp_path / "prof.json", tmp_path / "plan.json"
    profile.save(prof)
    assert main([str(prof), "-n", "4", "-b", "1e12", "--straight", "--schedule", str(table), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"train with PipelineConfig(mode='flush', schedule='{table}', flush_every=8)" in text
    record = json.loads(out.read_text())["settings"]["schedule"]
    assert record["name"] == str(table) and record["microbatches"] == 8
    refusals = {
        "runs windows of 8 minibatches; --microbatches is 4": ["-n", "4", "-b", "1e12", "--microbatches", "4"],
        "has 4 stages (one per rank), the plan 8": ["-n", "4", "-n", "2", "-b", "1e12", "-b", "1e9"],
    }
    for error, args in refusals.items():
        assert main([str(prof), *args, "--straight", "--schedule", str(table), "-o", str(tmp_path / "x.json")]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and error in err[0], err
    assert not (tmp_path / "x.json").exists()
