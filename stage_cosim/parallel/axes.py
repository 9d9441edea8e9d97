"""The mesh axes and communicator groups, as data.

Every stage of the flow reads these tables instead of naming axes itself: sharding asks an
axis which label it shards and whether it holds weight replicas, synthesis asks which
communicator groups exist, the schedule which group reduces a weight's gradient, the simulator
where a group's exposed time is charged. A new parallelism is a row here (and, if it needs
one, its rule in :mod:`stage_cosim.sharding.rules`), not a branch in every stage.

One set of ranks carries two named meshes, as Megatron-Core's MoE parallel folding does: the
*dense* mesh (tp, dp, pp) that attention and dense MLPs run on, and the *expert* mesh
(expert_tp, ep, edp, pp) that expert layers run on, over the same ranks: the tp x dp ranks of
a pipeline stage are re-factored as expert_tp x ep x edp (innermost first, in the dense mesh's
rank order). An axis belongs to one mesh; the pipeline axis ``pp`` is shared by both and is
not a block axis (it splits layers, not tensors). A tensor lives on one mesh; its tokens can be
read on the other (each axis names the label its tokens are split on there), which is how
routed tokens move between attention and the experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Mapping

PIPELINE_AXIS = "pp"


@dataclass(frozen=True)
class MeshAxis:
    """One mesh axis that shards the tensors inside a block."""

    name: str
    mesh: str
    # The label this axis shards in every op that has it (``dp``: the batch ``b``). None: the
    # tensor-parallel rule (the label a weight operand is sharded on, else the residual-stream
    # layout, else whatever an activation input is sharded on).
    shards: str | None
    # The axis holds replicas of the weights (a data-parallel axis): weight gradients leave the
    # backward Partial over it and are reduced, once per step, over the mesh's data-parallel
    # axes together (one communicator group); ZeRO shards weights, gradients and optimizer
    # states over that same group.
    data_parallel: bool = False
    # The label a micro-batch's tokens are split on over this axis in the residual-stream
    # layout (every rank of a stage holding its own tokens): dp the batch, tp the sequence
    # (sequence parallelism), the expert axes the token label n.
    tokens: str = ""
    # The label it shards in tensors and ops over the key sequence alone (an inference step's
    # KV cache and what is computed from it): cp splits the cached tokens as it splits the
    # sequence, each rank's cache holding its own tokens.
    keys: str = ""
    meaning: str = ""


# Block axes, mesh by mesh, in redistribution order: when a tensor changes placement on
# several axes, reductions go first (they shrink the data), then the axes in this order.
AXES: tuple[MeshAxis, ...] = (
    MeshAxis("tp", "dense", shards=None, tokens="s",
             meaning="tensor parallelism (Megatron column/row-parallel layers)"),
    # Context parallelism: every op runs on its own piece of the sequence; weights are
    # replicated over cp, so their gradients are reduced over dp and cp together (Megatron's
    # data-parallel group "with context parallel"). Attention, whose keys and values span the
    # whole sequence, exchanges them (sharding.context_parallel: the attention exchange).
    MeshAxis("cp", "dense", shards="s", data_parallel=True, tokens="s", keys="t",
             meaning="context parallelism over the sequence"),
    MeshAxis("dp", "dense", shards="b", data_parallel=True, tokens="b", meaning="data parallelism over the batch"),
    # Expert layers: ep holds a share of the experts (the expert label e), expert_tp shards each
    # expert's GEMMs as tp does, edp holds replicas of the experts and splits their tokens
    # (slots c). Dispatch and combine are placement changes on ep and expert_tp. The expert
    # mesh re-factors the ranks of tp, cp and dp, so edp folds cp in, as Megatron-Core does.
    MeshAxis("ep", "expert", shards="e", tokens="n", meaning="expert parallelism over the experts"),
    MeshAxis("expert_tp", "expert", shards=None, tokens="n", meaning="tensor parallelism inside each expert"),
    MeshAxis("edp", "expert", shards="c", data_parallel=True, tokens="n",
             meaning="expert data parallelism (the ranks left over: tp*cp*dp / (expert_tp*ep))"),
)

# The axes of each mesh, innermost first in the default rank mapping (Megatron's order with
# context parallelism: tp groups are consecutive ranks inside a scale-up domain, cp groups
# next to them, then dp; pp outermost).
MESHES: dict[str, tuple[str, ...]] = {
    "dense": ("tp", "cp", "dp", PIPELINE_AXIS),
    "expert": ("expert_tp", "ep", "edp", PIPELINE_AXIS),
}
DENSE, EXPERT = "dense", "expert"
# Sub-axes: an axis split into an inner factor of a size chosen per configuration (the
# hierarchical context parallelism of --cp-comm a2a+p2p: all-to-all inside groups of
# --cp-a2a-size consecutive cp ranks, the ring across them). Sub-axis -> its parent.
SUB_AXES: dict[str, str] = {"cp_a2a": "cp"}

AXIS: dict[str, MeshAxis] = {a.name: a for a in AXES}
BLOCK_AXES: tuple[str, ...] = tuple(a.name for a in AXES)


def mesh_of(axis: str) -> str:
    """The mesh an axis belongs to (the pipeline axis: the dense mesh, which names ranks)."""
    if axis in SUB_AXES:
        return mesh_of(SUB_AXES[axis])
    return AXIS[axis].mesh if axis in AXIS else DENSE


def expert_order(dense_order: tuple[str, ...]) -> tuple[str, ...]:
    """The expert mesh's axis order over the same ranks: the dense mesh's block axes (a
    contiguous run in its order) re-factored as expert_tp, ep, edp, innermost first."""
    block = [i for i, a in enumerate(dense_order) if a != PIPELINE_AXIS]
    if block != list(range(block[0], block[0] + len(block))):
        raise ValueError("the dense axes of a stage are not contiguous in the rank order")
    experts = tuple(a for a in MESHES[EXPERT] if a != PIPELINE_AXIS)
    return dense_order[:block[0]] + experts + dense_order[block[-1] + 1:]


def mesh_axes(mesh: str) -> tuple[str, ...]:
    """The block axes of ``mesh``, in redistribution order."""
    return tuple(a.name for a in AXES if a.mesh == mesh)


def data_parallel_axes(mesh: str) -> tuple[str, ...]:
    """The axes over which ``mesh`` replicates weights (their product is its gradient group)."""
    return tuple(a.name for a in AXES if a.mesh == mesh and a.data_parallel)


@dataclass(frozen=True)
class GroupKind:
    """A kind of communicator group: its members vary along ``axes`` (the others fixed)."""

    name: str
    axes: tuple[str, ...]
    # Where the simulator charges this group's exposed time (a breakdown category).
    category: str
    # Only the first and last member along the axes (the tied-embedding group of the first
    # and last pipeline stage).
    endpoints: bool = False
    # Pairs of mirrored members along the (one) axis, positions i and n-1-i: DualPipe's two
    # parameter copies put the layers of stage i on the ranks at pipeline positions i and
    # pp-1-i, whose gradients of each layer must be summed once per step.
    mirror: bool = False
    # Exists only in workloads whose nodes use it (the others are created whenever their
    # size exceeds one).
    on_demand: bool = False
    # A collective over these axes stays on this group when some of them have degree 1, unless
    # what is left is a group of the same category (the data-parallel group over dp and cp is
    # the dp group while cp = 1, but not the attention exchange's cp group while dp = 1).
    sticky: bool = False


# In group-id order (ids are numbered kind by kind, so existing kinds keep their ids).
GROUP_KINDS: tuple[GroupKind, ...] = (
    GroupKind("tp", ("tp",), "tp"),
    GroupKind("dp", ("dp",), "dp"),
    GroupKind("embedding", (PIPELINE_AXIS,), "embedding", endpoints=True),
    # Megatron's amax-reduction group of delayed FP8 scaling: every rank of a pipeline stage
    # (with context parallelism, its cp ranks too).
    GroupKind("tp_dp", ("tp", "dp"), "other", on_demand=True),
    GroupKind("ep", ("ep",), "ep"),
    GroupKind("expert_tp", ("expert_tp",), "tp"),
    GroupKind("edp", ("edp",), "dp"),
    # the attention exchange: K/V all-gathers, Ulysses all-to-alls and the ring's sends
    GroupKind("cp", ("cp",), "cp"),
    GroupKind("cp_a2a", ("cp_a2a",), "cp"),
    # weight gradients and ZeRO shards: data-parallel traffic, over dp and cp together
    GroupKind("dp_cp", ("cp", "dp"), "dp", sticky=True),
    GroupKind("tp_cp_dp", ("tp", "cp", "dp"), "other", on_demand=True),   # FP8 amax with cp
    # DualPipe's two copies of each layer (pipeline positions i and pp-1-i): their gradients
    # summed at step end, a reduction of weight replicas as the data-parallel one is. Only
    # DualPipe workloads have it (Workload decides; no pass template names it).
    GroupKind("mirror", (PIPELINE_AXIS,), "dp", mirror=True),
)
GROUP: dict[str, GroupKind] = {g.name: g for g in GROUP_KINDS}
_BY_AXES: dict[tuple[str, ...], str] = {g.axes: g.name for g in GROUP_KINDS if not (g.endpoints or g.mirror)}


def group_name(axes: tuple[str, ...]) -> str:
    """The name of the group spanning exactly ``axes`` (for node names)."""
    try:
        return _BY_AXES[tuple(axes)]
    except KeyError:
        raise ValueError(f"no communicator group spans the axes {axes}") from None


def resolve_group(axes: tuple[str, ...], degrees: Mapping[str, int]) -> str | None:
    """The communicator group a collective over ``axes`` runs on, given the degrees: axes of
    degree 1 drop out (a group over dp and cp with cp = 1 is the dp group), except that a sticky
    group is not traded for one of another category (with dp = 1 the gradients are still
    reduced on the data-parallel group over cp, not on the attention exchange's cp group); None
    when nothing is left (a collective over one rank is nothing)."""
    live = tuple(a for a in axes if degrees.get(a, 1) > 1)
    if not live:
        return None
    full = _BY_AXES.get(tuple(axes))
    name = _BY_AXES.get(live)
    if name is None:        # no narrower kind spans what is left: the group over all the axes
        return group_name(tuple(axes))
    if full is not None and GROUP[full].sticky and GROUP[name].category != GROUP[full].category:
        return full
    return name


def group_size(kind: str, degrees: Mapping[str, int]) -> int:
    g = GROUP[kind]
    return 2 if g.endpoints or g.mirror else prod(degrees.get(a, 1) for a in g.axes)


def peer_axis(kind: str) -> str:
    """The axis along which a send or receive of communication kind ``kind`` finds its peer
    (pipeline sends: ``pp``; the ring of the attention exchange: ``cp``)."""
    g = GROUP.get(kind)
    return g.axes[0] if g is not None else kind


def group_mesh(kind: str) -> str:
    """The mesh whose ranks a group kind's axes are coordinates of."""
    return mesh_of(GROUP[kind].axes[0])


def spans_stages(kind: str) -> bool:
    """Whether a group's members lie in several pipeline stages (else one stage holds them all)."""
    return PIPELINE_AXIS in GROUP[kind].axes


def category_of(kind: str) -> str:
    """The breakdown category of a communication kind ("pp" for pipeline sends and receives)."""
    g = GROUP.get(kind)
    return g.category if g is not None else kind
