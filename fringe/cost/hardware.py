"""Hardware presets and tensor shapes: what one rank can compute and move, as plain data.

The bottom layer of the cost model (:mod:`fringe.cost`): it imports nothing of fringe, so
:mod:`fringe.layout`'s balanced solver and the tile work model (:mod:`fringe.cost.work`) can
read it. :func:`check_head_split` is the rule for splitting H query and G kv heads k ways
(Ulysses), here because :meth:`Shape.buffer_bytes` needs it and every layer above (the
interpreter, plan stats, the simulator) asks it too.

Legend: B batch · H query heads · G kv heads · L tokens per rank · D head dim · Dv v head dim.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

__all__ = ["BWD_FLOPS_PER_PAIR", "FWD_FLOPS_PER_PAIR", "HARDWARE", "Hardware", "PER_RANK",
           "SHARED", "Shape", "check_head_split", "get_hardware"]

#: FLOPs per (q, kv) pair, per head and per unit of D: QKᵀ and PV in the forward (2 + 2),
#: and 2.5x that in the backward (the convention of :class:`fringe.plan.PlanStats`).
FWD_FLOPS_PER_PAIR = 4
BWD_FLOPS_PER_PAIR = 10

#: The name of a :class:`Hardware` one process measured for itself
#: (``fringe.cost.calibrate.calibrate()``): ``schedules.auto()`` refuses it.
PER_RANK = "this"
#: The name of a :class:`Hardware` measured once and the same on every rank
#: (``fringe.cost.calibrate.shared()``).
SHARED = "shared"


_DTYPES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class Shape:
    """The tensors a plan runs on: ``q [B, H, L, D]``, ``k [B, G, L, D]``, ``v [B, G, L, Dv]``.

    The default is one Llama-3-8B-like attention layer: H=32, G=8, D=128, bfloat16.
    ``v_head_dim`` (Dv) None means D; MLA (DeepSeek-V3) has a v head dim smaller than D.
    """

    batch: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128             # D of a Llama-3-70B-like layer (not a block size)
    dtype: str = "bfloat16"
    v_head_dim: int | None = None   # Dv of v and out (None: head_dim)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
        for f in ("batch", "heads", "kv_heads", "head_dim"):
            if getattr(self, f) < 1:
                raise ValueError(f"Shape.{f} must be >= 1, got {getattr(self, f)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.v_head_dim is not None and self.v_head_dim < 1:
            raise ValueError(f"Shape.v_head_dim must be >= 1 (or None: head_dim), got "
                             f"{self.v_head_dim}")

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype]

    @property
    def acc_itemsize(self) -> int:
        """Accumulators (out/lse, dq, dkv) are float32, float64 for float64."""
        return 8 if self.dtype == "float64" else 4

    def buffer_bytes(self, kind: str, L: int, *, split: int = 1) -> int:
        """Bytes of one buffer of ``kind`` (kv, dkv, q, dq, out, dout) holding ``L`` tokens.

        With ``split=k``, one head slice of k (``q3h1/4``): H/k query heads, and for kv the
        kv heads those read (G/k of them, or one when k % G == 0, as the interpreter holds
        them).

        Raises:
            ValueError: H and G cannot be split k ways (:func:`check_head_split`).
        """
        B, H, G, D = self.batch, self.heads, self.kv_heads, self.head_dim
        Dv = D if self.v_head_dim is None else self.v_head_dim
        if split != 1:
            check_head_split(split, H, G, what=f"a head slice of {split} (H={H}, G={G})")
            H, G = H // split, (G // split if G % split == 0 else 1)
        if kind == "kv":                     # k and v: G·(D + Dv) per token
            return B * G * L * (D + Dv) * self.itemsize
        if kind == "dkv":
            return B * G * L * (D + Dv) * self.acc_itemsize
        if kind == "q":
            return B * H * L * D * self.itemsize
        if kind == "dq":
            return B * H * L * D * self.acc_itemsize
        return B * H * L * (Dv + 1) * self.acc_itemsize     # a partial out + lse


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What one rank can compute and move, as data (with where the numbers come from).

    Attributes:
        name: preset name.
        source: where the numbers come from (datasheet, paper, or a measurement).
        fwd_flops: sustained attention FLOP/s of the kernel on FULL sub-problems, forward.
        bwd_flops: the same for the backward.
        call_s: fixed seconds per kernel call (sub-problem), forward.
        bwd_call_s: fixed seconds per kernel call, backward.
        masked: cost of a pair in a masked sub-problem, relative to a FULL pair (forward).
        causal: cost of a pair in a causal-aligned sub-problem run with ``is_causal``
            (counting the whole square: the kernel skips the upper half itself).
        bwd_masked: the masked factor for the backward (None: as the forward).
        bwd_causal: the causal factor for the backward (None: as the forward).
        row_s: seconds per (q row · head · D) element per tile (merging out/lse, adding dq).
        latency_s: seconds to start a transfer between two ranks of one node.
        bandwidth: bytes/s one way between two ranks of one node.
        node_size: ranks per node; 0 means all ranks share one node.
        inter_latency_s: latency between nodes.
        inter_bandwidth: bytes/s one way per rank between nodes.
        memory_bytes: memory per rank (None: not stated), to flag plans that do not fit.
        byte_s: seconds of the rank's own time per byte it sends or receives (transfers and
            collectives alike): the host-side work of moving a byte (the transport's copies,
            packing and unpacking buffers, accumulating received gradients). On a CPU it runs
            on the cores that compute, so it adds to the rank's busy time instead of
            overlapping with its tiles; 0 where the bytes move beside the compute (GPUs:
            copy engines and a separate stream).
        shape: the tensors the constants were measured or quoted for (``calibrate()``
            records what it timed; the presets say theirs): what ``schedules.auto()``
            predicts for when it is not given ``shape=``. None: not recorded (calibrate()'s
            default, H=G=8, D=64, float32, is assumed).
    """

    name: str
    source: str
    fwd_flops: float
    bwd_flops: float
    call_s: float
    bwd_call_s: float
    masked: float = 1.0
    causal: float = 0.6
    bwd_masked: float | None = None
    bwd_causal: float | None = None
    row_s: float = 0.0
    latency_s: float = 10e-6
    bandwidth: float = 100e9
    node_size: int = 0
    inter_latency_s: float = 20e-6
    inter_bandwidth: float = 50e9
    memory_bytes: float | None = None
    byte_s: float = 0.0
    shape: Shape | None = None

    def __post_init__(self) -> None:
        if self.shape is not None and not isinstance(self.shape, Shape):
            raise ValueError(f"Hardware {self.name!r}: shape must be a Shape or None, got "
                             f"{self.shape!r}")
        for f in ("name", "source"):
            if not isinstance(getattr(self, f), str):
                raise ValueError(f"Hardware {f} must be a str, got {getattr(self, f)!r}")
        # every constant a finite real number (a NaN or inf predicts NaN or inf step times,
        # which no comparison orders; a bool is no constant): a calibration file edited by
        # hand, or a measurement gone wrong, is refused here, naming the field
        for f in ("fwd_flops", "bwd_flops", "call_s", "bwd_call_s", "masked", "causal",
                  "bwd_masked", "bwd_causal", "row_s", "latency_s", "bandwidth",
                  "inter_latency_s", "inter_bandwidth", "memory_bytes", "byte_s"):
            v = getattr(self, f)
            if v is None and f in ("bwd_masked", "bwd_causal", "memory_bytes"):
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise ValueError(f"Hardware {self.name!r}: {f} must be a finite number, got "
                                 f"{v!r}")
        for f in ("fwd_flops", "bwd_flops", "bandwidth", "inter_bandwidth", "masked", "causal",
                  "bwd_masked", "bwd_causal", "memory_bytes"):
            if getattr(self, f) is not None and not getattr(self, f) > 0:
                raise ValueError(f"Hardware {self.name!r}: {f} must be > 0, got {getattr(self, f)}")
        for f in ("call_s", "bwd_call_s", "row_s", "latency_s", "inter_latency_s", "byte_s"):
            if getattr(self, f) < 0:
                raise ValueError(f"Hardware {self.name!r}: {f} must be >= 0, got {getattr(self, f)}")
        if (isinstance(self.node_size, bool) or not isinstance(self.node_size, numbers.Integral)
                or self.node_size < 0):
            raise ValueError(f"Hardware {self.name!r}: node_size must be an integer >= 0 (0 = one "
                             f"node), got {self.node_size!r}")

    def collective_s(self, n, nbytes, intra):
        """Seconds of collectives over ``n`` members moving ``nbytes`` (arrays), ``intra``:
        all members on one node (NVLink), else across nodes (the slower link bounds a ring).

        ``(n - 1) * latency + nbytes / bandwidth``: the alpha-beta cost of a ring all-gather or
        reduce-scatter and of a pairwise all-to-all, n - 1 rounds each (Thakur, Rabenseifner
        and Gropp, "Optimization of Collective Communication Operations in MPICH", IJHPCA
        2005, sec. 4; NCCL's ring algorithms, nccl-tests doc/PERFORMANCE.md "bus bandwidth").
        ``nbytes`` is what the busiest member moves, counting only non-empty contributions:
        for an all-gather the bytes a member receives (in a ring every byte it gathers enters
        it once), for a reduce-scatter the bytes a member sends (its adjoint), for an
        all-to-all the larger of the two. A full all-gather of b bytes per member gives the
        textbook ``(n - 1) * (latency + b / bandwidth)``.
        """
        n = np.asarray(n, dtype=np.float64)
        intra = np.asarray(intra, dtype=bool)
        lat = np.where(intra, self.latency_s, self.inter_latency_s)
        bw = np.where(intra, self.bandwidth, self.inter_bandwidth)
        return np.maximum(n - 1, 0) * lat + np.asarray(nbytes, dtype=np.float64) / bw

    def transfer_s(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Seconds of the transfers ``src[i] -> dst[i]`` of ``nbytes[i]`` bytes: latency + bytes /
        bandwidth of their link (``latency_s`` / ``bandwidth`` when both ends sit in one node of
        ``node_size`` consecutive ranks, else ``inter_latency_s`` / ``inter_bandwidth``).
        ``nbytes`` (float64) is overwritten with the result: 16.8M transfers a direction at
        P=4,096, where per-transfer latency and bandwidth arrays took 268 MB."""
        out = nbytes
        if not self.node_size:
            out /= self.bandwidth
            out += self.latency_s
            return out
        same = (src // self.node_size) == (dst // self.node_size)
        far = ~same
        np.divide(out, self.bandwidth, out=out, where=same)
        np.divide(out, self.inter_bandwidth, out=out, where=far)
        np.add(out, self.latency_s, out=out, where=same)
        np.add(out, self.inter_latency_s, out=out, where=far)
        return out


# Sources. H100 SXM: NVIDIA H100 datasheet (NVLink 4: 900 GB/s bidirectional per GPU, so 450 GB/s
# one way; 80 GB HBM3); NCCL point-to-point reaches ~80% of it. Attention throughput:
# FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608, figs. 5-7): BF16 forward ~600 TFLOP/s
# at head dim 128 and long sequences, backward ~450 TFLOP/s; a kernel launch + tail ~5 us.
# Masked blocks (FlexAttention's mask_mod on partial blocks) ~1.3x a full block (attention-gym
# FlexAttention blog, "block sparsity" benchmarks). InfiniBand: NDR 400 Gb/s per GPU (one
# ConnectX-7 per GPU in DGX H100) = 50 GB/s one way, ~45 GB/s achieved by NCCL, ~20 us.
_H100 = dict(fwd_flops=600e12, bwd_flops=450e12, call_s=5e-6, bwd_call_s=8e-6, masked=1.3,
             causal=0.55, row_s=1e-14, latency_s=10e-6, bandwidth=360e9, memory_bytes=80e9)

#: Measured on this repository's shared 2-core x86 runner by
#: :func:`fringe.cost.calibrate.calibrate` (torch 2.13, 1 thread per rank, float32, H=8 D=64,
#: fused CPU SDPA through fringe.ops; CPU time of the calling thread). gloo between two
#: processes over shared memory measured 0.9-9.5 GB/s and 0.1-2 ms round-trip latency
#: depending on the load from other processes: 2 GB/s and 0.1 ms are taken. Re-measure with
#: ``costmodel.calibrate()`` or ``--hardware this`` elsewhere.
#: ``byte_s`` (host seconds per byte a rank sends or receives) is fitted on whole steps: the 36
#: P=2 (cell, candidate) points of BENCHMARKS.md's auto section as measured on main at 56a8293 /
#: 9279c90 (causal, document, sliding window 512; S=4096 and 8192; ring, zigzag, striped,
#: balanced, allgather, ulysses; 7 rounds at load 2-3), the busiest rank's CPU seconds per
#: fwd+bwd step against this preset's predicted busiest compute plus ``byte_s`` x the bytes it
#: moves, one scale per cell: least squares of the log ratios gives 1.4e-9 (residual 0.042;
#: 0.243 without the term; a per-call term instead of it, 3.25 ms per call, 0.078). It is what
#: separates ulysses and striped (~100 MB moved per rank at S=8192) from ring, zigzag, balanced
#: and allgather (2-13 MB on windows and documents): measured 1.12-1.31x the fastest there,
#: predicted within 3% of it without the term. In this preset's units (its compute ~1.8x this
#: runner's single-thread CPU seconds) that is ~0.78 ns per byte of the runner's own time.
#: ``fringe.cost.calibrate`` measures ``byte_s`` through fringe: the same ring step at P=2 with
#: whole kv chunks and with block ranges (same tiles), the extra process CPU seconds over the
#: extra bytes: 0.3-0.76 ns/B on this runner (18 calibrations at load 1.7-3.3, median 0.41),
#: 2-3x gloo's round trips alone (0.1-0.3 ns/B) and about half the fitted figure; the rest of
#: the fit (ulysses's all-to-alls, striped's calls) is not broken down.
_CPU = dict(fwd_flops=4.5e10, bwd_flops=4.1e10, call_s=1.0e-4, bwd_call_s=1.6e-4, masked=1.25,
            bwd_masked=1.3, causal=0.6, row_s=1.1e-8, latency_s=1.0e-4, bandwidth=2.0e9,
            memory_bytes=None, byte_s=1.4e-9)

HARDWARE: dict[str, Hardware] = {
    "h100-nvlink": Hardware("h100-nvlink", "one DGX H100 node (8 GPUs, NVLink 4); H100 datasheet, "
                            "FlashAttention-3 paper", node_size=8, inter_latency_s=10e-6,
                            inter_bandwidth=360e9, shape=Shape(), **_H100),
    "h100-ib": Hardware("h100-ib", "DGX H100 nodes of 8 over InfiniBand NDR 400 Gb/s per GPU; "
                        "H100 datasheet, FlashAttention-3 paper, ConnectX-7 spec",
                        node_size=8, inter_latency_s=20e-6, inter_bandwidth=45e9, shape=Shape(),
                        **_H100),
    "cpu": Hardware("cpu", "this repository's 2-core CPU runner, gloo over shared memory; "
                    "measured by costmodel.calibrate() (re-run it for your machine)",
                    shape=Shape(heads=8, kv_heads=8, head_dim=64, dtype="float32"), **_CPU),
}


def get_hardware(hardware: str | Hardware) -> Hardware:
    """A preset by name, or a :class:`Hardware` as is.

    ``"this"`` (measure this machine) is the tools layer's: :func:`fringe.cost.calibrate.
    get_hardware` calibrates for it; here it is refused, saying so.

    Raises:
        ValueError: for an unknown name, listing the presets.
    """
    if isinstance(hardware, Hardware):
        return hardware
    if hardware == "this":
        raise ValueError("hardware='this' measures this machine: call "
                         "fringe.cost.calibrate.calibrate() (costmodel.calibrate()) once and pass "
                         "the Hardware it returns, or use a preset: " + ", ".join(sorted(HARDWARE)))
    try:
        return HARDWARE[hardware]
    except KeyError:
        raise ValueError(f"unknown hardware {hardware!r}; choose one of "
                         f"{sorted(HARDWARE) + ['this']} or pass a costmodel.Hardware") from None


def check_head_split(n: int, num_heads: int, kv_heads: int, *, what: str = "") -> None:
    """Raise a ValueError naming the fix unless H % n == 0 and (G % n == 0 or n % G == 0)."""
    if num_heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0):
        return
    who = what or f"a schedule that splits heads {n} ways"
    if num_heads % n:
        raise ValueError(f"{who} needs the number of query heads divisible by {n}, got H="
                         f"{num_heads}; use H a multiple of {n}, or split heads fewer ways "
                         f"(schedules.compose(ring-like outer, ulysses(), inner_size=k) with k "
                         f"dividing H)")
    raise ValueError(f"{who} needs the kv heads G={kv_heads} to split {n} ways (G % {n} == 0) "
                     f"or to be replicated across the {n} ranks ({n} % G == 0); G={kv_heads} is "
                     f"neither: use G dividing or divisible by {n}")
