"""One pipeline stage of a plan: a contiguous layer range on its replicas and tensor groups.

Pure data model, no torch. Stage ``s`` holds layers ``[start, end)`` replicated r_s times.
Beyond the paper, a stage may shard its layers over a tensor-parallel group of t_s devices
(Megatron-LM, Shoeybi et al. 2019): ``devices`` then lists all ``r_s x t_s`` devices
replica-major, replica j's tensor group being ``devices[j*t_s:(j+1)*t_s]``, and
``r_s = len(devices) / t_s``. The group's first device stands for the replica in the schedule
(:attr:`StagePlan.replica_devices`); the other ranks of the group run the same actions. With
t_s = 1 (the default) every device is a replica, as in the paper.

Replica ``j`` computes on slice j of every micro-batch (:mod:`dapple.core.slicing`): an even
split by default, or ``shares[j]`` whole samples when the replicas run at different speeds
(the shares sum to the plan's micro-batch size, which :class:`~dapple.core.plan.Plan` checks).

A stage with mixture-of-experts layers may shard each such layer's experts over e_s of its
replicas (expert parallelism, ``expert_width``): consecutive replicas ``[k*e_s, (k+1)*e_s)``
form one expert group that holds every expert once, replica ``j`` holding expert shard
``j % e_s``; the replicas holding the same shard average its gradients. e_s = 1 (the default):
every replica holds every expert.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dapple.core._json import get_field, require
from dapple.core.parallelism import Parallelism
from dapple.core.recompute import Recompute, full_if, recompute_of
from dapple.core.slicing import split_sizes
from dapple.errors import ValidationError

__all__ = ["StagePlan"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StagePlan:
    """One pipeline stage: a contiguous layer range replicated over a device set."""

    layers: tuple[int, int]
    """Layer range ``[start, end)`` of the chain."""
    devices: tuple[int, ...]
    """Device ids of all ``r_s x t_s`` devices, replica-major: replica ``j`` runs on the tensor
    group ``devices[j*t_s:(j+1)*t_s]`` (``devices[j]`` when t_s = 1)."""
    recompute: Recompute = Recompute.NONE
    """``full``: re-compute the stage's forward during its backward, keeping only the stage
    input; ``none``: keep the activations (:mod:`dapple.core.recompute`; a plan file written
    before the modes had ``true``/``false``, read as ``full``/``none``)."""
    max_in_flight: int | None = None
    """D: how many micro-batches' activations fit on the device (None: unbounded)."""
    zero_stage: int = 0
    """1: the replicas shard the stage's optimizer state (ZeRO-1, ``dapple.runtime.parallel.zero``);
    2: its gradients too (ZeRO-2); 3: its parameters too (ZeRO-3 / FSDP,
    ``dapple.runtime.parallel.fsdp``); 0: every replica keeps all of it. Meaningful only with
    ``r_s > 1`` (3 is refused on one replica)."""
    tensor_width: int = 1
    """t_s: devices of one replica's tensor-parallel group (a power of two), all in one server
    (:func:`dapple.core.tensor_layout.check_tensor_groups`); 1: no tensor parallelism."""
    regather: bool = False
    """ZeRO-3 only: re-shard the parameters after every forward and backward and all-gather
    them again per micro-batch (less memory, more traffic); False: gather once per step."""
    shares: tuple[int, ...] | None = None
    """Samples of each micro-batch per replica, in replica order (whole samples >= 1 each,
    summing to the micro-batch size b); None: the even split ``split_sizes(b, r_s)``. The plan
    file records them only when they differ from the even split."""
    expert_width: int = 1
    """e_s: replicas over which each mixture-of-experts layer's experts are sharded (a divisor
    of r_s); 1: every replica holds every expert."""
    parallel: Parallelism = field(init=False, repr=False, compare=False)
    """r_s, t_s, the zero stage, regather and e_s as one value, checked, with what they mean
    (:class:`~dapple.core.parallelism.Parallelism`); built from the fields above."""

    def __post_init__(self) -> None:
        s, e = self.layers
        require(
            isinstance(s, int) and isinstance(e, int) and 0 <= s < e,
            f"stage layers must be [start, end) with 0 <= start < end, got {list(self.layers)}",
        )
        require(len(self.devices) >= 1, f"stage {list(self.layers)} has no devices")
        require(
            all(isinstance(d, int) and d >= 0 for d in self.devices),
            f"stage {list(self.layers)}: device ids must be integers >= 0, got {list(self.devices)}",
        )
        require(
            self.max_in_flight is None or self.max_in_flight >= 1,
            f"stage {list(self.layers)}: max_in_flight must be >= 1, got {self.max_in_flight}",
        )
        what = f"stage {list(self.layers)}: recompute"
        object.__setattr__(self, "recompute", recompute_of(self.recompute, what))
        self._check_parallel()
        self._check_shares()

    def _check_shares(self) -> None:
        """One whole share >= 1 per replica (their sum is the plan's to check)."""
        if self.shares is None:
            return
        got, what = self.shares, f"stage {list(self.layers)}"
        require(
            isinstance(got, (tuple, list)),
            f"{what}: shares must be a list of whole samples per replica, got {got!r}"[:200],
        )
        require(
            len(got) == self.replicas,
            f"{what}: shares {list(got)} name {len(got)} replicas, the stage has {self.replicas} "
            f"(devices {list(self.devices)}, tensor_width={self.tensor_width})",
        )
        require(
            all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in got),
            f"{what}: shares {list(got)} must be whole samples >= 1 each",
        )
        object.__setattr__(self, "shares", tuple(got))  # a list from a caller, kept hashable

    def slice_sizes(self, b: int) -> tuple[int, ...]:
        """The replicas' slices of a micro-batch of ``b`` samples: ``shares``, or the even split.

        Raises:
            ValidationError: the shares do not sum to ``b``.
        """
        return split_sizes(b, self.replicas, self.shares)

    def _check_parallel(self) -> None:
        """The devices are whole tensor groups of t_s; :attr:`parallel` built and checked."""
        t, n, what = self.tensor_width, len(self.devices), f"stage {list(self.layers)}"
        width = isinstance(t, int) and not isinstance(t, bool) and t >= 1  # else Parallelism's
        require(
            not width or n % t == 0,
            f"{what}: its {n} devices {list(self.devices)} are not whole tensor groups of "
            f"tensor_width={t}",
        )
        try:
            parallel = Parallelism(
                replicas=n // t if width else n,
                tensor_width=t,
                zero_stage=self.zero_stage,
                regather=self.regather,
                expert_width=self.expert_width,
            )
        except ValidationError as e:
            raise ValidationError(f"{what}: {e}") from e
        object.__setattr__(self, "parallel", parallel)

    @property
    def replicas(self) -> int:
        """r_s, the number of replicas (tensor groups)."""
        return self.parallel.replicas

    @property
    def replica_devices(self) -> tuple[int, ...]:
        """The first device of each replica's tensor group, in replica order: the device that
        stands for the replica in schedules and split-concat (``devices`` when t_s = 1)."""
        return self.devices[:: self.tensor_width] if self.parallel.tensor_parallel else self.devices

    def tensor_group(self, replica: int) -> tuple[int, ...]:
        """The t_s devices of replica ``replica``'s tensor group."""
        t = self.tensor_width
        return self.devices[replica * t : (replica + 1) * t]

    def replica_group(self, tensor_rank: int) -> tuple[int, ...]:
        """The r_s devices holding tensor shard ``tensor_rank``: the group that all-reduces
        (or reduce-scatters and gathers) that shard's gradients over the replicas."""
        return self.devices[tensor_rank :: self.tensor_width]

    def expert_group(self, replica: int) -> tuple[int, ...]:
        """The replica indices of ``replica``'s expert group: the e_s consecutive replicas that
        together hold every expert once (``(replica,)`` when e_s = 1)."""
        e = self.expert_width
        first = replica - replica % e
        return tuple(range(first, first + e))

    def expert_shard_replicas(self, replica: int) -> tuple[int, ...]:
        """The replica indices holding the same expert shard as ``replica`` (``j % e_s``): the
        replicas that average that shard's gradients."""
        return tuple(range(replica % self.expert_width, self.replicas, self.expert_width))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "layers": list(self.layers),
            "devices": list(self.devices),
            "recompute": self.recompute.value,
        }
        if self.max_in_flight is not None:
            d["max_in_flight"] = self.max_in_flight
        if self.zero_stage:
            d["zero_stage"] = self.zero_stage
        if self.parallel.tensor_parallel:
            d["tensor_width"] = self.tensor_width
        if self.regather:
            d["regather"] = True
        if self.shares is not None and self.shares != split_sizes(sum(self.shares), self.replicas):
            d["shares"] = list(self.shares)
        if self.parallel.expert_parallel:
            d["expert_width"] = self.expert_width
        return d

    @staticmethod
    def from_dict(d: Any, index: int) -> StagePlan:
        what = f"plan stage {index}"
        require(isinstance(d, dict), f"{what} must be an object, got {d!r}")
        layers = get_field(d, "layers", what)
        require(
            isinstance(layers, list)
            and len(layers) == 2
            and all(isinstance(x, int) for x in layers),
            f"{what}: layers must be [start, end), got {layers!r}",
        )
        devices = get_field(d, "devices", what)
        require(
            isinstance(devices, list) and all(isinstance(x, int) for x in devices),
            f"{what}: devices must be a list of integer ids, got {devices!r}",
        )
        mif = d.get("max_in_flight")
        require(
            mif is None or isinstance(mif, int),
            f"{what}: max_in_flight must be an integer, got {mif!r}",
        )
        shares = d.get("shares")
        require(
            shares is None or isinstance(shares, list),
            f"{what}: shares must be a list of whole samples per replica, got {shares!r}"[:200],
        )
        try:
            return StagePlan(
                layers=(layers[0], layers[1]),
                devices=tuple(devices),
                recompute=_recompute_field(d.get("recompute", Recompute.NONE)),
                max_in_flight=mif,
                zero_stage=d.get("zero_stage", 0),
                tensor_width=d.get("tensor_width", 1),
                regather=d.get("regather", False),
                shares=None if shares is None else tuple(shares),
                expert_width=d.get("expert_width", 1),
            )
        except ValidationError as e:
            raise ValidationError(f"{what}: {e}") from e


def _recompute_field(value: Any) -> Any:
    """A plan file's ``recompute``: ``true``/``false`` from a file written before the modes
    read as ``full``/``none``; other values as they are (the stage checks them)."""
    return full_if(value) if isinstance(value, bool) else value
