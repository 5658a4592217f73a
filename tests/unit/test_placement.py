"""The placement plan (:mod:`vime_core.cluster.placement`): exact layouts, and one test per refusal with its exact
text."""

import pytest

from vime_core.cli.arguments import ArgumentError, parse_run_args
from vime_core.cluster.placement import NodeResources, PlacementError, ResourceFlags, plan_placement

pytestmark = pytest.mark.unit


def nodes(*gpus: int) -> list[NodeResources]:
    """Nodes n0, n1, ... at 10.0.0.1, 10.0.0.2, ... with the given GPU counts; n0 is the driver's."""
    return [NodeResources(f"n{i}", f"10.0.0.{i + 1}", g, i == 0) for i, g in enumerate(gpus)]


def layout(plan) -> tuple:
    return (
        [(b.index, b.node_id, b.gpus, b.holds) for b in plan.bundles],
        [(s.name, s.node_id, s.bundles, s.num_gpus) for s in plan.trainer],
        [(s.name, s.node_id, s.bundles, s.num_gpus) for s in plan.engines],
    )


def test_cpu_plan_is_todays_layout_everything_on_the_driver_node_without_bundles():
    plan = plan_placement(ResourceFlags(rollout_num_engines=2), nodes(0, 0))
    assert plan.mode == "cpu"
    assert layout(plan) == (
        [],
        [("trainer rank 0", "n0", [], 0.0)],
        [("engine 0", "n0", [], 0.0), ("engine 1", "n0", [], 0.0)],
    )
    assert plan.describe().splitlines()[1] == "  trainer rank 0: no GPU, on the driver's node 10.0.0.1 (node n0)"


def test_one_node_eight_gpus_colocated_tp2():
    flags = ResourceFlags(actor_num_gpus_per_node=8, colocate=True, rollout_num_gpus_per_engine=2)
    plan = plan_placement(flags, nodes(8))
    assert plan.mode == "colocated" and plan.tp == 2
    bundles, trainer, engines = layout(plan)
    assert bundles[:3] == [
        (0, "n0", 1, ["trainer rank 0", "engine 0"]),
        (1, "n0", 1, ["trainer rank 1", "engine 0"]),
        (2, "n0", 1, ["trainer rank 2", "engine 1"]),
    ]
    assert len(bundles) == 8 and trainer[7] == ("trainer rank 7", "n0", [7], 0.5)
    assert engines == [(f"engine {e}", "n0", [2 * e, 2 * e + 1], 0.5) for e in range(4)]


def test_two_nodes_disaggregated_8_train_8_rollout_driver_first():
    # the driver's node is listed second: it is still filled first
    ns = [NodeResources("b", "10.0.0.2", 8), NodeResources("a", "10.0.0.9", 8, is_driver=True)]
    plan = plan_placement(ResourceFlags(actor_num_gpus_per_node=8, rollout_num_gpus=8), ns)
    bundles, trainer, engines = layout(plan)
    assert plan.mode == "disaggregated"
    assert trainer == [(f"trainer rank {r}", "a", [r], 1.0) for r in range(8)]
    assert engines == [(f"engine {e}", "b", [8 + e], 1.0) for e in range(8)]
    assert bundles[8] == (8, "b", 1, ["engine 0"])


def test_tp2_engines_fill_the_gpus_left_on_each_node():
    plan = plan_placement(
        ResourceFlags(actor_num_gpus_per_node=2, rollout_num_gpus=6, rollout_num_gpus_per_engine=2), nodes(4, 4)
    )
    _, trainer, engines = layout(plan)
    assert trainer == [("trainer rank 0", "n0", [0], 1.0), ("trainer rank 1", "n0", [1], 1.0)]
    assert engines == [("engine 0", "n0", [2], 2.0), ("engine 1", "n1", [3], 2.0), ("engine 2", "n1", [4], 2.0)]
    assert plan.to_dict()["bundles"][2] == {
        "index": 2,
        "node_id": "n0",
        "node_ip": "10.0.0.1",
        "gpus": 2,
        "holds": ["engine 0"],
        "gpu_ids": [],
    }


def test_two_trainer_nodes_number_ranks_node_by_node():
    plan = plan_placement(ResourceFlags(actor_num_nodes=2, actor_num_gpus_per_node=2, rollout_num_gpus=1), nodes(2, 3))
    _, trainer, engines = layout(plan)
    assert [(t[0], t[1]) for t in trainer] == [
        ("trainer rank 0", "n0"),
        ("trainer rank 1", "n0"),
        ("trainer rank 2", "n1"),
        ("trainer rank 3", "n1"),
    ]
    assert engines == [("engine 0", "n1", [4], 1.0)]


def test_debug_modes_plan_only_their_side():
    flags = ResourceFlags(actor_num_gpus_per_node=1, rollout_num_gpus=1, rollout=False)
    plan = plan_placement(flags, nodes(1))
    assert len(plan.trainer) == 1 and plan.engines == []
    plan = plan_placement(ResourceFlags(actor_num_gpus_per_node=1, rollout_num_gpus=1, train=False), nodes(1))
    assert plan.trainer == [] and [e.bundles for e in plan.engines] == [[0]]


def test_external_engines_are_not_placed():
    """``--rollout-external``: the engines run elsewhere, so the plan holds the trainer alone (its GPU bundle only)."""
    flags = ResourceFlags(actor_num_gpus_per_node=1, rollout_num_engines=2, external_engines=True)
    plan = plan_placement(flags, nodes(1))
    assert layout(plan) == ([(0, "n0", 1, ["trainer rank 0"])], [("trainer rank 0", "n0", [0], 1.0)], [])
    cpu = plan_placement(ResourceFlags(rollout_num_engines=2, external_engines=True), nodes(0))
    assert layout(cpu) == ([], [("trainer rank 0", "n0", [], 0.0)], [])


def refusal(flags: ResourceFlags, ns: list[NodeResources]) -> str:
    with pytest.raises(PlacementError) as e:
        plan_placement(flags, ns)
    return str(e.value)


def test_refuses_tp_below_one():
    assert refusal(ResourceFlags(rollout_num_gpus_per_engine=0), nodes(8)) == (
        "--rollout-num-gpus-per-engine must be >= 1, got 0"
    )


def test_refuses_zero_trainer_nodes():
    assert refusal(ResourceFlags(actor_num_nodes=0), nodes(8)) == "--actor-num-nodes must be >= 1, got 0"


def test_refuses_negative_gpus():
    assert refusal(ResourceFlags(rollout_num_gpus=-1), nodes(8)) == (
        "--actor-num-gpus-per-node and --rollout-num-gpus must be >= 0"
    )


def test_refuses_several_trainer_nodes_without_gpus():
    assert refusal(ResourceFlags(actor_num_nodes=2), nodes(8)) == (
        "--actor-num-nodes 2 needs --actor-num-gpus-per-node >= 1 (a trainer without GPUs runs as one rank)"
    )


def test_refuses_tp_not_dividing_rollout_gpus():
    flags = ResourceFlags(actor_num_gpus_per_node=4, rollout_num_gpus=3, rollout_num_gpus_per_engine=2)
    assert refusal(flags, nodes(8)) == (
        "--rollout-num-gpus-per-engine 2 must divide --rollout-num-gpus 3 "
        "(each engine takes that many GPUs of one node)"
    )


def test_refuses_engine_count_disagreeing_with_rollout_gpus():
    flags = ResourceFlags(actor_num_gpus_per_node=4, rollout_num_gpus=4, rollout_num_engines=3)
    assert refusal(flags, nodes(8)) == (
        "--rollout-num-engines 3 disagrees with --rollout-num-gpus 4 / --rollout-num-gpus-per-engine 1 = 4 engines; "
        "leave --rollout-num-engines out"
    )


def test_refuses_tensor_parallel_cpu_engines():
    assert refusal(ResourceFlags(rollout_num_gpus_per_engine=2), nodes(0)) == (
        "--rollout-num-gpus-per-engine 2 (tensor parallel) needs GPU engines: set --rollout-num-gpus"
    )


def test_refuses_colocate_without_trainer_gpus():
    assert refusal(ResourceFlags(colocate=True), nodes(8)) == (
        "--colocate needs trainer GPUs: set --actor-num-gpus-per-node"
    )


def test_refuses_colocated_engines_with_more_gpus_than_the_trainer():
    flags = ResourceFlags(colocate=True, actor_num_gpus_per_node=4, rollout_num_gpus=8)
    assert refusal(flags, nodes(8)) == (
        "--colocate: --rollout-num-gpus 8 exceeds the trainer's --actor-num-nodes × --actor-num-gpus-per-node = 4 "
        "GPUs the engines share"
    )


def test_refuses_colocated_tp_not_dividing_gpus_per_node():
    flags = ResourceFlags(colocate=True, actor_num_gpus_per_node=3, rollout_num_gpus=2, rollout_num_gpus_per_engine=2)
    assert refusal(flags, nodes(8)) == (
        "--colocate: --rollout-num-gpus-per-engine 2 must divide --actor-num-gpus-per-node 3 "
        "(an engine's GPUs are on one node)"
    )


def test_refuses_more_gpus_than_the_cluster_has():
    assert refusal(ResourceFlags(actor_num_gpus_per_node=8, rollout_num_gpus=8), nodes(8)) == (
        "the plan needs 16 GPUs (--actor-num-nodes 1 × --actor-num-gpus-per-node 8 + --rollout-num-gpus 8) "
        "but the Ray cluster has 8 GPU(s) on 1 node(s)"
    )


def test_refuses_trainer_nodes_the_cluster_lacks():
    assert refusal(ResourceFlags(actor_num_nodes=2, actor_num_gpus_per_node=4), nodes(8, 2)) == (
        "--actor-num-nodes 2 × --actor-num-gpus-per-node 4: only 1 node(s) of the Ray cluster have 4 GPUs"
    )


def test_refuses_an_engine_that_fits_no_node():
    flags = ResourceFlags(actor_num_gpus_per_node=3, rollout_num_gpus=4, rollout_num_gpus_per_engine=4)
    assert refusal(flags, nodes(4, 3)) == (
        "engine 0 needs --rollout-num-gpus-per-engine 4 GPUs on one node, but no node of the Ray cluster has that "
        "many left after the trainer's (free: 10.0.0.1=1, 10.0.0.2=3)"
    )


BASE = ["--model", "m", "--prompt-data", "d.jsonl"]


def test_flag_checks_run_while_parsing_and_derive_the_engine_count():
    args = parse_run_args(
        BASE + ["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2"]
    )
    assert args.rollout_num_engines == 2
    assert parse_run_args(BASE).rollout_num_engines == 1 and parse_run_args(BASE).ray_address is None
    with pytest.raises(ArgumentError, match=r"^--rollout-num-gpus-per-engine 2 must divide --rollout-num-gpus 3 "):
        parse_run_args(BASE + ["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"])


def test_colocate_needs_the_sync_loop():
    with pytest.raises(ArgumentError) as e:
        parse_run_args(BASE + ["--actor-num-gpus-per-node", "1", "--colocate", "--loop", "one-step-off", "--use-tis"])
    assert str(e.value) == "--colocate needs --loop sync: with --loop one-step-off generation overlaps training"


def test_sync_loop_with_one_cpu_engine_binds_the_engine_to_every_core():
    """generation and training never overlap in the sync loop: the one CPU engine's OpenMP threads get every core
    (vLLM's 'auto' keeps one for its spin-waiting engine-core process); other loops and explicit binds are kept."""
    import os

    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    expected = [cores] if len(cores.split(",")) > 1 else None
    assert parse_run_args(BASE).rollout_cpu_bind == expected
    assert parse_run_args(BASE + ["--loop", "one-step-off", "--use-tis"]).rollout_cpu_bind is None
    assert parse_run_args(BASE + ["--rollout-cpu-bind", "0"]).rollout_cpu_bind == ["0"]
    assert parse_run_args(BASE + ["--rollout-num-engines", "2"]).rollout_cpu_bind is None
