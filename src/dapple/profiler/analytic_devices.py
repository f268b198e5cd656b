"""Datasheet numbers and roofline efficiencies of the GPUs the analytic profiler models.

Pure, no torch. One :class:`DeviceSpec` per device kind: peak dense FLOP/s per precision and
HBM bandwidth from the vendor's datasheet, and one :class:`Efficiency` per precision: the
fraction of peak each operation class reaches in a training step (a roofline's ceilings scaled
down). :mod:`dapple.profiler.analytic` turns FLOPs and bytes into time with them.

Datasheets (dense numbers; NVIDIA prints the Tensor Core rates of A100 and H100 "with
sparsity", twice the dense rate, and the tables below halve them):

* V100: "NVIDIA Tesla V100 GPU Accelerator" datasheet, SXM2 column: 15.7 TFLOP/s fp32,
  125 TFLOP/s Tensor Core (fp16), 900 GB/s HBM2, 16 or 32 GB.
* A100: "NVIDIA A100 Tensor Core GPU" datasheet, 80GB SXM column: 19.5 TFLOP/s fp32,
  312 TFLOP/s bf16/fp16 Tensor Core (624 with sparsity), 2,039 GB/s HBM2e, 80 GB.
* H100: "NVIDIA H100 Tensor Core GPU" datasheet, SXM column: 67 TFLOP/s fp32, 989 TFLOP/s
  bf16/fp16 Tensor Core (1,979 with sparsity), 1,979 TFLOP/s fp8 (3,958 with sparsity),
  3.35 TB/s HBM3, 80 GB.
* H200: "NVIDIA H200 Tensor Core GPU" datasheet, SXM column: the H100's peaks, 4.8 TB/s
  HBM3e, 141 GB.

Efficiencies: three operation classes (:data:`OP_CLASSES`), each with one number per device
and precision:

* ``matmul``: GEMMs of the linear layers, the LM head and eager attention, as a fraction of the
  precision's peak. Fitted where a published run dapple can express exists (each value's
  comment names the run and ``benchmarks/published.md`` the fit), else a prior.
* ``attention``: the fused (flash) attention kernel's FLOPs as a fraction of the 16-bit Tensor
  Core peak. Prior: FlashAttention-2 (Dao, 2023) reports 50-73% of A100 peak forward and
  about 63% backward; on H100 the same kernels reach 35-50% (FlashAttention-3, Shah et al.
  2024, figure 1), cuDNN's fused attention more.
* ``memory``: element-wise and reduction kernels (norms, activations, residual adds, rotary,
  softmax, embeddings, cross entropy) as a fraction of HBM bandwidth. Prior 0.8: streaming
  copies reach 85-92% of peak HBM bandwidth on these parts; framework element-wise kernels a
  little less.

``KERNEL_GAP_US``: fixed per-kernel time (launch and tail), charged once per kernel as the
fixed part of each call.

Fitted on measurement (:data:`FITTED`, the H100 and H200): finer classes (:data:`OPTIONAL_CLASSES`:
eager attention's core, the LM head, unaligned GEMMs, embeddings) and a per-kernel gap, in two
kernel settings (:data:`KERNEL_SETTINGS`): ``eager``, fitted by ``benchmarks/gpu_fit.py`` on
dapple's own profile of three models on one H200 (``benchmarks/gpu_fit.md``; every value's
comment names its rows), and ``fused``, the GEMM measured on the same H200 with priors
elsewhere, for frameworks with fused or compiled kernels (``benchmarks/published.md``). The
H200 profiles eager by default (:attr:`DeviceSpec.default_kernels`); the H100 keeps its priors
unless a setting is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dapple.core.cluster import GIB
from dapple.core.precision import ComputePrecision, precision_of
from dapple.errors import ValidationError

__all__ = [
    "DEVICES",
    "FITTED",
    "KERNEL_GAP_US",
    "KERNEL_SETTINGS",
    "OPTIONAL_CLASSES",
    "OP_CLASSES",
    "DeviceSpec",
    "Efficiency",
    "fitted_efficiency",
    "get_device",
]

_TRAINING_PREFERENCE = (ComputePrecision.BF16, ComputePrecision.FP16, ComputePrecision.FP32)
"""What a model trains in on a device, first choice first (:attr:`DeviceSpec.default_precision`)."""

OP_CLASSES = ("matmul", "attention", "memory")
"""Operation classes, each with its own efficiency."""
OPTIONAL_CLASSES = ("eager_attention", "head", "unaligned", "embedding")
"""Finer classes fitted on measured layers (:data:`FITTED`); unset, they fall back to the
three of :data:`OP_CLASSES`."""
KERNEL_SETTINGS = ("eager", "fused")
"""Kernel settings of the fitted efficiencies: ``eager`` (eager PyTorch under autocast, what
dapple runs and profiles) and ``fused`` (compiled or fused kernels: torchtitan with
torch.compile, Megatron with Transformer Engine)."""

KERNEL_GAP_US = 4.0
"""Fixed time per kernel (launch latency and the tail of a dependent kernel), microseconds."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Efficiency:
    """Fraction of the roofline's ceilings one operation class reaches (each in (0, 1])."""

    matmul: float
    """GEMMs: fraction of the precision's peak FLOP/s."""
    attention: float
    """Fused attention: fraction of the 16-bit Tensor Core peak FLOP/s."""
    memory: float
    """Element-wise kernels: fraction of the HBM bandwidth."""
    eager_attention: float | None = None
    """Eager attention's core (scores and context GEMMs, softmax, masks): fraction of the
    precision's peak FLOP/s and of the HBM bandwidth; None: ``matmul`` and ``memory``."""
    head: float | None = None
    """The LM head's GEMM: fraction of the precision's peak; None: ``matmul``."""
    unaligned: float | None = None
    """GEMMs with a dimension not a multiple of 8 elements (GPT-2's 50,257-word head):
    fraction of the peak; None: as aligned ones."""
    embedding: float | None = None
    """Embedding lookups and their table gradient: fraction of the HBM bandwidth; None:
    ``memory``."""
    kernel_gap_us: float = KERNEL_GAP_US
    """Fixed time per kernel, microseconds (:data:`KERNEL_GAP_US` unless fitted)."""
    note: str = ""
    """Where the numbers come from (a fit's published run, a measured row, or a prior)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.kernel_gap_us, (int, float)) and self.kernel_gap_us >= 0):
            raise ValidationError(
                f"Efficiency.kernel_gap_us must be >= 0, got {self.kernel_gap_us!r}"
            )
        for name in OP_CLASSES + OPTIONAL_CLASSES:
            v = getattr(self, name)
            if v is None and name in OPTIONAL_CLASSES:
                continue
            if not (isinstance(v, (int, float)) and 0 < v <= 1):
                raise ValidationError(f"Efficiency.{name} must be in (0, 1], got {v!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    """One GPU kind: datasheet peaks and the efficiencies of each precision."""

    name: str
    """Short name (``h100``)."""
    label: str
    """The part the datasheet numbers are for."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s of GEMMs per precision
    (:data:`~dapple.core.precision.ANALYTIC_PRECISIONS`)."""
    hbm_bytes_per_s: float
    """Peak HBM bandwidth, bytes/s."""
    memory_bytes: int
    """Device memory, bytes."""
    efficiency: dict[str, Efficiency] = field(default_factory=dict)
    """Efficiencies per precision."""
    default_kernels: str | None = None
    """The kernel setting (:data:`KERNEL_SETTINGS`) an analytic profile gets when none is asked
    for (None: :attr:`efficiency` without autocast's casts)."""

    @property
    def default_precision(self) -> str:
        """What a model trains in on this device unless told otherwise: bf16 where the
        datasheet has it, else fp16, else fp32."""
        return next(p.value for p in _TRAINING_PREFERENCE if p.value in self.peak_flops)

    def matmul_peak(self, precision: str) -> float:
        """Peak FLOP/s of GEMMs in ``precision``.

        Raises:
            ValidationError: the device has no such precision (V100 has no bf16 or fp8).
        """
        if precision not in self.peak_flops:
            raise ValidationError(
                f"{self.label} has no {precision} peak; it supports {', '.join(self.peak_flops)}"
            )
        return self.peak_flops[precision]

    def attention_peak(self, precision: str) -> float:
        """Peak FLOP/s of the fused attention kernel: 16-bit Tensor Cores (fp8 runs attention in
        bf16), fp32 in fp32."""
        if not precision_of(precision).autocast:
            return self.matmul_peak(precision)
        return self.peak_flops.get("bf16", self.peak_flops.get("fp16", 0.0))

    def efficiency_for(self, precision: str) -> Efficiency:
        """The efficiencies of ``precision``.

        Raises:
            ValidationError: the device has no such precision.
        """
        self.matmul_peak(precision)
        return self.efficiency[precision]


_MEMORY = 0.8
"""Prior fraction of HBM bandwidth reached by element-wise kernels (module docstring)."""

DEVICES: dict[str, DeviceSpec] = {
    "v100": DeviceSpec(
        name="v100",
        label="NVIDIA V100 SXM2",
        peak_flops={"fp32": 15.7e12, "fp16": 125e12},
        hbm_bytes_per_s=900e9,
        memory_bytes=16 * GIB,
        efficiency={
            # matmul fitted on the DAPPLE paper's BERT-48, DAPPLE schedule, M=16 without RC
            # (8.18 samples/s; benchmarks/published.md); attention is eager (matmul class) in
            # fp32, so its value only matters for a flash profile asked for explicitly.
            "fp32": Efficiency(
                matmul=0.622,
                attention=0.622,
                memory=_MEMORY,
                note="matmul fitted on dapple-paper-bert48-dapple-m16 (published.md)",
            ),
            # matmul fitted on Megatron-LM v1's 1.2B GPT-2 on one V100 (1288 ms per step; a
            # DGX-2H V100 at 450 W, above this datasheet's peak); attention there is eager.
            "fp16": Efficiency(
                matmul=0.828,
                attention=0.5,
                memory=_MEMORY,
                note="matmul fitted on megatron-v1-gpt2-1.2b (published.md)",
            ),
        },
    ),
    "a100": DeviceSpec(
        name="a100",
        label="NVIDIA A100 SXM4 80GB",
        peak_flops={"fp32": 19.5e12, "bf16": 312e12, "fp16": 312e12},
        hbm_bytes_per_s=2039e9,
        memory_bytes=80 * GIB,
        efficiency={
            # priors: no published A100 run dapple can express yet (all are FSDP).
            p.value: Efficiency(
                matmul=0.8 if p.autocast else 0.85,
                attention=0.6,
                memory=_MEMORY,
                note="prior (not fitted)",
            )
            for p in ComputePrecision
            if p.trains
        },
    ),
    "h100": DeviceSpec(
        name="h100",
        label="NVIDIA H100 SXM5 80GB",
        peak_flops={"fp32": 66.9e12, "bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12},
        hbm_bytes_per_s=3.35e12,
        memory_bytes=80 * GIB,
        efficiency={
            # priors: no published H100 bf16 run dapple can express yet (FSDP, TP).
            **{
                p.value: Efficiency(
                    matmul=0.7 if p.autocast else 0.85,
                    attention=0.5,
                    memory=_MEMORY,
                    note="prior (not fitted)",
                )
                for p in ComputePrecision
                if p.trains
            },
            # matmul fitted on NeMo's LLAMA2-7B pretraining, 8 H100, fp8 (16,847 tokens/s/GPU).
            "fp8": Efficiency(
                matmul=0.476,
                attention=0.5,
                memory=_MEMORY,
                note="matmul fitted on nemo-2407-llama2-7b (published.md)",
            ),
        },
    ),
    # H200: "NVIDIA H200 Tensor Core GPU" datasheet, SXM column: the H100's peaks (989 TFLOP/s
    # bf16 dense, 1,979 fp8 dense, 67 fp32), 141 GB HBM3e at 4.8 TB/s. The measured part
    # (/work/shared/evidence/h200-2026-11-28) reports 143,771 MiB; 141 GB is the datasheet's.
    "h200": DeviceSpec(
        name="h200",
        label="NVIDIA H200 SXM 141GB",
        peak_flops={"fp32": 66.9e12, "bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12},
        hbm_bytes_per_s=4.8e12,
        memory_bytes=141 * 10**9,
        efficiency={},  # filled below: the fitted eager efficiencies (FITTED)
        default_kernels="eager",  # what dapple runs, as measured on this part
    ),
}
"""The modelled devices by short name."""


def get_device(name: str) -> DeviceSpec:
    """The :class:`DeviceSpec` named ``name`` (case-insensitive).

    Raises:
        ValidationError: unknown device.
    """
    spec = DEVICES.get(name.lower())
    if spec is None:
        raise ValidationError(f"unknown analytic device {name!r}; known: {', '.join(DEVICES)}")
    return spec


HOPPER = ("h100", "h200")
"""Parts sharing the fitted efficiencies of :data:`FITTED`: the same SMs and peaks (the H200
is an H100 with HBM3e), so the same fractions of peak; only the bandwidth differs."""

_EAGER_BF16 = Efficiency(
    # Each value: `python benchmarks/gpu_fit.py` over benchmarks/gpu_measured.toml (dapple's
    # profile on one H200, bf16 autocast, /work/shared/evidence/h200-2026-11-28/
    # run1-analytic_vs_measured.md); leave-one-out errors of every row in benchmarks/gpu_fit.md.
    # not fitted on a row: the bf16 GEMM 8192^3 measured on the same H200, 796 of 989.4 TFLOP/s
    # (the evidence file's first line). Fitting it too on the Llama blocks gives 0.84.
    matmul=0.805,
    # rows llama:block{0,1}:b{1,2}, F and B, fitted with kernel_gap_us: SDPA given the traced
    # HF model's materialised causal mask (attention="masked": no flash kernel, all s^2 tiles).
    attention=0.143,
    # the same rows: HF's eager blocks launch more kernels than the ops count (RMSNorm in fp32 as
    # 6 kernels, rotary as 10, autocast's casts), and b=1 against b=2 separates the fixed part.
    kernel_gap_us=27.3,
    memory=0.8,  # not fitted: the prior (no row is element-wise alone)
    # rows zoo:block{0,1}:b{1,2} (the zoo transformer's eager attention at seq 2048; its softmax
    # runs in fp32 under autocast), F and B:
    eager_attention=0.127,
    # rows llama:lm_head:b{1,2} and zoo:lm_head:b{1,2} (vocabulary 128,256 and 32,000), F and B:
    head=0.911,
    # rows gpt2:lm_head:b{1,2} (vocabulary 50,257: no Tensor Core-aligned layout), F and B:
    unaligned=0.127,
    # rows gpt2/llama/zoo:embedding:b{1,2}, backward only (HF's prologue forward is host-bound):
    embedding=0.428,
    note="eager: fitted on dapple's H200 profile (benchmarks/gpu_fit.md)",
)
_FUSED_BF16 = Efficiency(
    # GEMMs (blocks and head): the one direct GEMM measurement of the same run, bf16 8192^3 at
    # 796 TFLOP/s of 989.4 (the evidence file's first line, not a table row), as eager: fused
    # and compiled frameworks run the same cuBLAS GEMMs, without autocast's casts and the eager
    # kernels around them (so the default per-kernel gap). Their vocabularies are padded to
    # multiples of 64 or 128, so no unaligned class.
    matmul=0.805,
    # prior: no causal flash kernel was measured (dapple's traced HF models pass a mask; the
    # masked kernel's 0.143 above is not what torchtitan's is_causal SDPA or TE run).
    attention=0.5,
    memory=0.8,  # prior: no fused element-wise kernel was measured
    note="fused: GEMMs at the H200's measured 8192^3 GEMM, the rest priors (benchmarks/gpu_fit.md)",
)
FITTED: dict[tuple[str, str], Efficiency] = {
    ("bf16", "eager"): _EAGER_BF16,
    ("fp16", "eager"): _EAGER_BF16,  # the same Tensor Core rate; fp16 was not measured
    ("bf16", "fused"): _FUSED_BF16,
    ("fp16", "fused"): _FUSED_BF16,
}
"""Efficiencies fitted on measured layers, by (precision, kernel setting), for the
:data:`HOPPER` parts. ``eager`` profiles count autocast's weight casts
(``layer_costs(autocast=True)``) and, unless told otherwise, time attention as SDPA given a
mask (``attention="masked"``), as the fit did."""

DEVICES["h200"].efficiency.update(
    {
        "fp32": DEVICES["h100"].efficiency["fp32"],  # prior, as the H100's
        "bf16": _EAGER_BF16,
        "fp16": _EAGER_BF16,
        "fp8": DEVICES["h100"].efficiency["fp8"],  # the H100's NeMo fit
    }
)


def fitted_efficiency(device: DeviceSpec | str, precision: str, kernels: str) -> Efficiency:
    """The efficiencies fitted for ``kernels`` (:data:`KERNEL_SETTINGS`) on ``device``.

    Raises:
        ValidationError: an unknown setting, or a device or precision without a fit.
    """
    dev = device if isinstance(device, DeviceSpec) else get_device(device)
    if kernels not in KERNEL_SETTINGS:
        raise ValidationError(
            f"kernels must be one of {', '.join(KERNEL_SETTINGS)}, got {kernels!r}"
        )
    eff = FITTED.get((precision, kernels)) if dev.name in HOPPER else None
    if eff is None:
        fitted = sorted({p for p, _ in FITTED})
        raise ValidationError(
            f"no {kernels} efficiencies fitted for {dev.label} in {precision}; fitted: "
            f"{', '.join(HOPPER)} in {', '.join(fitted) or 'nothing'}"
        )
    return eff
