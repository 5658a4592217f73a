"""The placement plan: which Ray placement-group bundle holds which trainer rank and which vLLM engine, on which node.

:func:`plan_placement` is a pure function of slime's resource flags (:class:`ResourceFlags`) and the Ray cluster's
nodes, computed before anything expensive starts, so every layout (CPU, disaggregated, colocated) and every refusal
is unit-tested; :mod:`vime_core.cluster.orchestration` then asks Ray for exactly this plan. The layouts:
docs/cluster.md, "The plan".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from vime_core.config import ClusterConfig
from vime_core.config.errors import ArgumentError

#: GPU share of a bundle each side takes in a colocated plan (trainer rank and engine share one GPU).
COLOCATED_SHARE = 0.5


class PlacementError(ValueError):
    """An impossible placement plan; the message names the flag to change."""


@dataclass(frozen=True)
class NodeResources:
    """One Ray node as the plan sees it.

    :ivar node_id: Ray's node id (hex), the value of the node's ``ray.io/node-id`` label.
    :ivar ip: the node's address (``NodeManagerAddress``).
    :ivar gpus: whole ``GPU`` resources the node declares.
    :ivar is_driver: the node the driver (and so the router) runs on.
    """

    node_id: str
    ip: str
    gpus: int
    is_driver: bool = False


@dataclass(frozen=True)
class ResourceFlags:
    """The flags a plan depends on (slime's names); see :func:`ResourceFlags.from_config`."""

    actor_num_nodes: int = 1
    actor_num_gpus_per_node: int = 0
    rollout_num_gpus: int = 0
    rollout_num_gpus_per_engine: int = 1
    rollout_num_engines: int = 1
    colocate: bool = False
    train: bool = True  # False with --debug-rollout-only
    rollout: bool = True  # False with --debug-train-only
    external_engines: bool = False  # --rollout-external: the engines run elsewhere, the plan places none
    trainer_tp: int = 1  # --tensor-model-parallel-size (megatron)
    trainer_ep: int = 1  # --expert-model-parallel-size (megatron, MoE)

    @classmethod
    def from_config(cls, cfg: ClusterConfig) -> ResourceFlags:
        """The flags of the run's cluster section."""
        return cls(
            actor_num_nodes=int(cfg.actor_num_nodes),
            actor_num_gpus_per_node=int(cfg.actor_num_gpus_per_node),
            rollout_num_gpus=int(cfg.rollout_num_gpus or 0),
            rollout_num_gpus_per_engine=int(cfg.rollout_num_gpus_per_engine),
            rollout_num_engines=int(cfg.rollout_num_engines),
            colocate=bool(cfg.colocate),
            train=not cfg.debug_rollout_only,
            rollout=not cfg.debug_train_only,
            external_engines=bool(cfg.rollout_external),
            trainer_tp=int(cfg.tensor_model_parallel_size or 1),
            trainer_ep=int(cfg.expert_model_parallel_size or 1),
        )


@dataclass
class Bundle:
    """Bundle ``index`` of the placement group: ``gpus`` GPUs on node ``node_id``; ``holds`` names its tenants;
    ``gpu_ids`` are the GPU ids Ray assigned (known only after placement)."""

    index: int
    node_id: str
    node_ip: str
    gpus: int
    holds: list[str] = field(default_factory=list)
    gpu_ids: list[str] = field(default_factory=list)  # filled once Ray placed the bundle


@dataclass
class Slot:
    """Where one actor goes: ``bundles`` (its placement-group bundles; empty: no bundle, the driver's node), the
    GPU share it asks Ray for (``num_gpus``), and the node."""

    name: str
    node_id: str
    node_ip: str
    bundles: list[int]
    num_gpus: float


@dataclass
class PlacementPlan:
    """The whole plan: ``mode`` (``"cpu"``, ``"disaggregated"`` or ``"colocated"``), the bundles, one slot per
    trainer rank (``trainer[r]`` is rank ``r``) and one per engine (``engines[e]``), each engine's tensor-parallel
    size ``tp``."""

    mode: str
    bundles: list[Bundle]
    trainer: list[Slot]
    engines: list[Slot]
    tp: int
    trainer_ep: int = 1  # --expert-model-parallel-size: the trainer ranks form EP groups of this many

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (written to ``OUTPUT_DIR/plan.json``)."""
        return asdict(self)

    def describe(self) -> str:
        """One line per bundle / slot, e.g. ``bundle 0: 1 GPU on 10.0.0.1 (node 3f2a…) — trainer rank 0``."""
        lines = [
            f"placement ({self.mode}): {len(self.trainer)} trainer rank(s), {len(self.engines)} engine(s), "
            f"TP={self.tp}" + (f", trainer EP={self.trainer_ep}" if self.trainer_ep > 1 else "")
        ]
        for b in self.bundles:
            ids = f" [GPU ids {','.join(b.gpu_ids)}]" if b.gpu_ids else ""
            lines.append(
                f"  bundle {b.index}: {b.gpus} GPU on {b.node_ip} (node {b.node_id[:8]}){ids} — {', '.join(b.holds)}"
            )
        for s in [*self.trainer, *self.engines]:
            if not s.bundles:
                lines.append(f"  {s.name}: no GPU, on the driver's node {s.node_ip} (node {s.node_id[:8]})")
        return "\n".join(lines)


def _driver(nodes: list[NodeResources]) -> NodeResources:
    for n in nodes:
        if n.is_driver:
            return n
    return nodes[0]


def ordered_nodes(nodes: list[NodeResources]) -> list[NodeResources]:
    """The order bundles are filled in: the driver's node first, then by address and node id."""
    return sorted(nodes, key=lambda n: (not n.is_driver, n.ip, n.node_id))


def _check_expert_parallel(flags: ResourceFlags, train_gpus: int) -> None:
    """The trainer's expert-parallel groups fit its ranks: one GPU per rank, each group of
    ``--expert-model-parallel-size`` × ``--tensor-model-parallel-size`` ranks (megatron-core's expert-TP × EP group;
    the experts' TP size is the TP size) inside the world.

    :raises PlacementError: naming the flags.
    """
    ep, tp = flags.trainer_ep, flags.trainer_tp
    if ep < 1:
        raise PlacementError(f"--expert-model-parallel-size must be >= 1, got {ep}")
    if ep == 1 or not flags.train:
        return
    if not train_gpus:
        raise PlacementError(
            f"--expert-model-parallel-size {ep} needs trainer GPUs (one rank per GPU, --trainer megatron): set "
            "--actor-num-gpus-per-node"
        )
    if train_gpus % (ep * tp):
        raise PlacementError(
            f"--expert-model-parallel-size {ep} × --tensor-model-parallel-size {tp} must divide the trainer's "
            f"--actor-num-nodes × --actor-num-gpus-per-node = {train_gpus} GPUs"
        )


def plan_placement(flags: ResourceFlags, nodes: list[NodeResources]) -> PlacementPlan:
    """Compute the placement plan (see the module docstring for the layouts).

    :param flags: the resource flags.
    :param nodes: the Ray cluster's alive nodes (at least one).
    :return: the plan.
    :raises PlacementError: for an impossible plan, naming the flag (exact texts are unit-tested).
    """
    tp, train_gpus, rollout_gpus, num_engines = _gpu_counts(flags)
    order = ordered_nodes(nodes)
    driver = _driver(order)
    _check_capacity(flags, tp, train_gpus, rollout_gpus, order)
    free = {n.node_id: n.gpus for n in order}
    bundles: list[Bundle] = []
    trainer: list[Slot] = []
    engines: list[Slot] = []

    def take(node: NodeResources, gpus: int, holder: str) -> Bundle:
        free[node.node_id] -= gpus
        b = Bundle(len(bundles), node.node_id, node.ip, gpus, [holder])
        bundles.append(b)
        return b

    if train_gpus:
        hosts = [n for n in order if n.gpus >= flags.actor_num_gpus_per_node][: flags.actor_num_nodes]
        if len(hosts) < flags.actor_num_nodes:
            raise PlacementError(
                f"--actor-num-nodes {flags.actor_num_nodes} × --actor-num-gpus-per-node "
                f"{flags.actor_num_gpus_per_node}: only {len(hosts)} node(s) of the Ray cluster have "
                f"{flags.actor_num_gpus_per_node} GPUs"
            )
        share = COLOCATED_SHARE if flags.colocate else 1.0
        for node in hosts:
            for _ in range(flags.actor_num_gpus_per_node):
                b = take(node, 1, f"trainer rank {len(trainer)}")
                trainer.append(Slot(f"trainer rank {len(trainer)}", node.node_id, node.ip, [b.index], share))
    elif flags.train:
        trainer.append(Slot("trainer rank 0", driver.node_id, driver.ip, [], 0.0))

    if flags.colocate:
        for e in range(num_engines):
            idx = list(range(e * tp, e * tp + tp))
            for i in idx:
                bundles[i].holds.append(f"engine {e}")
            first = bundles[idx[0]]
            engines.append(Slot(f"engine {e}", first.node_id, first.node_ip, idx, COLOCATED_SHARE))
    elif rollout_gpus:
        for e in range(num_engines):
            node = next((n for n in order if free[n.node_id] >= tp), None)
            if node is None:
                raise PlacementError(
                    f"engine {e} needs --rollout-num-gpus-per-engine {tp} GPUs on one node, but no node of the Ray "
                    f"cluster has that many left after the trainer's (free: "
                    f"{', '.join(f'{n.ip}={free[n.node_id]}' for n in order)})"
                )
            b = take(node, tp, f"engine {e}")
            engines.append(Slot(f"engine {e}", node.node_id, node.ip, [b.index], float(tp)))
    else:
        engines = [Slot(f"engine {e}", driver.node_id, driver.ip, [], 0.0) for e in range(num_engines)]
    mode = "colocated" if flags.colocate else ("disaggregated" if bundles else "cpu")
    return PlacementPlan(mode, bundles, trainer, engines, tp, flags.trainer_ep)


def _gpu_counts(flags: ResourceFlags) -> tuple[int, int, int, int]:
    """``(GPUs per engine, trainer GPUs, rollout GPUs, engines)`` the flags ask for, whatever the cluster.

    :raises PlacementError: flags that contradict each other, naming them.
    """
    tp = flags.rollout_num_gpus_per_engine
    if tp < 1:
        raise PlacementError(f"--rollout-num-gpus-per-engine must be >= 1, got {tp}")
    if flags.actor_num_nodes < 1:
        raise PlacementError(f"--actor-num-nodes must be >= 1, got {flags.actor_num_nodes}")
    if flags.actor_num_gpus_per_node < 0 or flags.rollout_num_gpus < 0:
        raise PlacementError("--actor-num-gpus-per-node and --rollout-num-gpus must be >= 0")
    train_gpus = flags.actor_num_nodes * flags.actor_num_gpus_per_node if flags.train else 0
    rollout_gpus = flags.rollout_num_gpus if flags.rollout else 0
    if flags.actor_num_gpus_per_node == 0 and flags.actor_num_nodes > 1:
        raise PlacementError(
            f"--actor-num-nodes {flags.actor_num_nodes} needs --actor-num-gpus-per-node >= 1 "
            "(a trainer without GPUs runs as one rank)"
        )
    _check_expert_parallel(flags, train_gpus)
    if flags.colocate and rollout_gpus == 0 and flags.rollout:
        rollout_gpus = train_gpus  # slime: colocated engines use the trainer's GPUs unless told otherwise
    if rollout_gpus % tp:
        raise PlacementError(
            f"--rollout-num-gpus-per-engine {tp} must divide --rollout-num-gpus {rollout_gpus} "
            "(each engine takes that many GPUs of one node)"
        )
    if rollout_gpus and flags.rollout_num_engines not in (1, rollout_gpus // tp):
        raise PlacementError(
            f"--rollout-num-engines {flags.rollout_num_engines} disagrees with --rollout-num-gpus {rollout_gpus} / "
            f"--rollout-num-gpus-per-engine {tp} = {rollout_gpus // tp} engines; leave --rollout-num-engines out"
        )
    if not rollout_gpus and tp > 1 and flags.rollout:
        raise PlacementError(
            f"--rollout-num-gpus-per-engine {tp} (tensor parallel) needs GPU engines: set --rollout-num-gpus"
        )
    num_engines = (rollout_gpus // tp if rollout_gpus else flags.rollout_num_engines) if flags.rollout else 0
    if flags.external_engines:  # --rollout-external: engines vime neither starts nor places
        num_engines = 0
    return tp, train_gpus, rollout_gpus, num_engines


def _check_capacity(
    flags: ResourceFlags, tp: int, train_gpus: int, rollout_gpus: int, order: list[NodeResources]
) -> None:
    """Whether the cluster's GPUs (``order``: its nodes) can hold the trainer's and the engines' GPUs.

    :raises PlacementError: naming the flags, what they need and what the cluster has.
    """
    total = sum(n.gpus for n in order)
    if flags.colocate:
        if not train_gpus:
            raise PlacementError("--colocate needs trainer GPUs: set --actor-num-gpus-per-node")
        if rollout_gpus > train_gpus:
            raise PlacementError(
                f"--colocate: --rollout-num-gpus {rollout_gpus} exceeds the trainer's "
                f"--actor-num-nodes × --actor-num-gpus-per-node = {train_gpus} GPUs the engines share"
            )
        if flags.actor_num_gpus_per_node % tp:
            raise PlacementError(
                f"--colocate: --rollout-num-gpus-per-engine {tp} must divide --actor-num-gpus-per-node "
                f"{flags.actor_num_gpus_per_node} (an engine's GPUs are on one node)"
            )
        need = train_gpus
    else:
        need = train_gpus + rollout_gpus
    if need > total:
        raise PlacementError(
            f"the plan needs {need} GPUs (--actor-num-nodes {flags.actor_num_nodes} × --actor-num-gpus-per-node "
            f"{flags.actor_num_gpus_per_node}{'' if flags.colocate else f' + --rollout-num-gpus {rollout_gpus}'}) "
            f"but the Ray cluster has {total:g} GPU(s) on {len(order)} node(s)"
        )


def check_resource_flags(flags: ResourceFlags) -> int:
    """The checks that need no cluster (run while parsing flags): plan against a cluster as large as needed.

    :return: the number of engines the flags ask for (``--rollout-num-gpus / --rollout-num-gpus-per-engine`` when
        engines have GPUs, else ``--rollout-num-engines``; 0 with ``--debug-train-only``).
    :raises PlacementError: as :func:`plan_placement`.
    """
    big = 1 << 20
    nodes = [NodeResources(f"virtual-{i}", f"virtual-{i}", big, i == 0) for i in range(flags.actor_num_nodes)]
    return len(plan_placement(flags, nodes).engines)


def parse_cpu_list(spec: str) -> set[int]:
    """``"1"``, ``"0-3"``, ``"2-3,6"`` → a set of core ids (taskset's list syntax).

    :raises ArgumentError: naming ``--train-cpus`` on a malformed list.
    """
    cpus: set[int] = set()
    try:
        for part in str(spec).split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ArgumentError(f"--train-cpus {spec!r}: expected core ids like '1', '0-3' or '2-3,6'") from None
    if not cpus:
        raise ArgumentError(f"--train-cpus {spec!r}: no core")
    return cpus
