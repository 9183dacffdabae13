"""Small-M GEMMs of the decode step at memory bandwidth: y = x @ W.T for decode batches (chapter 10).

What it computes
    x [M, K] and W [N, K] (row-major, as nn.Linear stores it), optional bias [N]:
    - `linear`:          y = x @ W.T + bias, [M, N] in x's dtype (the QKV projection, K=1024, N=4096);
    - `linear_partials`: split-K partial sums P[s] = x[:, Ks] @ W[:, Ks].T, [S, M, N] fp32, which the next
      kernel adds up (kernels/rms_norm.py after o_proj and down_proj; kernels/qk_norm_rope_store.py after
      the QKV projection), so the GEMM needs no reduction kernel of its own;
    - `linear_silu_mul`: W = [W_gate; W_up] ([2I, K], the merged gate_up projection) and
      y = silu(x @ W_gate.T) * (x @ W_up.T), [M, I]: the SwiGLU gate in the GEMM's epilogue.

Why
    At decode batch sizes a projection is a matrix-vector product: it reads all N * K weights to do 2*M*N*K
    flops, so its speed is bytes per second. Round 2 measured cuBLAS at 34 % of the H200's bandwidth at
    batch 1 over 141 launches a step; published measurements put cuBLAS at 49-68 % on narrow-N shapes
    like o_proj (K=2048, N=1024) and down (K=3072, N=1024), where it splits K and runs a reduction kernel.
    A kernel reaches bandwidth when enough programs stream long contiguous runs of W at once: here about
    two programs per SM (264 on the H200's 132 SMs), each reading BLOCK_N rows of W in BLOCK_K-long runs.
    Narrow N has too few column tiles for that, so it also splits K (`split_k`).

Two formulations (`GemmConfig.use_dot`)
    - GEMV (M = 1 by default): no tensor cores. Each K step loads a [BLOCK_N, BLOCK_K] tile of W once and,
      for each of the M rows, multiplies it by that row of x and sums along K (`tl.sum`). Compute is
      M * N * K FMAs on the CUDA cores, far below the time to read W for M <= 4.
    - tl.dot (M > 1): the same tiles through the tensor cores, M padded to BLOCK_M >= 16 (a GPU's dot needs
      every tile side >= 16; the interpreter does not care).
    Both accumulate in fp32. The output is rounded to the model dtype, as cuBLAS rounds; the SiLU epilogue
    rounds gate and up, silu(gate) and the product, as the reference ops (layers/activation.py) do.

    More rows than TILE_M (64) are cut into row tiles (grid axis 2), up to MAX_M (512) rows.

Weights before the wait (round 13, `GemmConfig.preload`)
    With PDL a kernel starts while the one in front finishes and waits (`gdc_wait`) before reading its output.
    W is no kernel's output, so at one row each program loads its whole K range of W (one K step) before that
    wait, and the add + RMSNorm and attention-merge kernels in front let it launch at their start: the weights
    stream in while they run (the 1-row decode GEMM chain 24.6 -> 22.7 us a layer on an H100,
    bench/results/kernels_round13_h100_2026-12-07_call2.json). With tl.dot (2-64 rows) it made the chain
    7-21 % slower, so choose_config leaves it off there.

Configurations are picked by shape, deterministically (`choose_config`), never autotuned: this runs inside
CUDA-graph capture, where timing candidate kernels is impossible. `bench/kernels_round3.py` and
`bench/kernels_round5.py` sweep candidates on the GPU to pick them. The engine serves batches of up to
FusedKernels.max_m = 64 rows here and larger ones with cuBLAS (`F.linear`; the callers dispatch): whole
Qwen3-0.6B decoder layers on the H200 took 127 us at 128 rows with these kernels against 110 with cuBLAS's
GEMMs, 213 against 184 at 256 (bench/results/kernels_round5_h200_2026-12-02.json).
"""
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm_ref.kernels.numerics import DEFINED_INTERPRETED, interpreting, pdl_launch_kwargs, round_to  # noqa: F401

MAX_M = 512                # the kernel's limit; the engine's FusedKernels.max_m says which batches it serves
TILE_M = 64                # above this many rows the rows are cut into tiles of TILE_M (grid axis 2)
# Up to this M the default is the dot-free GEMV. Measured on the H200 (bench/results/kernels_round3_h200.json):
# at M=1 the GEMV beats cuBLAS on every projection, at M=4 it is 1.1-1.7x slower than cuBLAS on the wide ones
# (each row re-reads the W tile), while tl.dot with M padded to 16 is level with cuBLAS there.
GEMV_MAX_M = 1


def preloads_weights(m: int) -> bool:
    """True where choose_config's pick for m rows loads its weights before the PDL wait (round 13: the GEMV form
    only). The kernels in front of a GEMM (kernels/rms_norm.py, kernels/qk_norm_rope_store.py) let the next kernel
    launch at their start exactly then, so that the weights stream in while they run; elsewhere an early launch
    only parks waiting programs on the SMs."""
    return m <= GEMV_MAX_M


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and launch options of one small GEMM (powers of two). split_k: how many K ranges the
    partial-sums form cuts K into (the launched count is cdiv(K, k_per_split(K)), which may be smaller).
    preload: load the first K step's weight tile before waiting for the kernel in front (PDL's gdc_wait): the
    weights depend on nothing the step computes, so their first HBM round trip overlaps that kernel's tail
    (it changes no value: the same tiles are summed in the same order). launch_early: let the kernel behind
    launch right after that load instead of after the K loop (only with preload)."""
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    use_dot: bool = False
    num_warps: int = 4
    num_stages: int = 2
    preload: bool = False
    launch_early: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"GemmConfig.{name} must be a power of two, got {v!r}")
        if not isinstance(self.split_k, int) or self.split_k < 1:
            raise ValueError(f"GemmConfig.split_k must be an int >= 1, got {self.split_k!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"GemmConfig.num_stages must be an int >= 1, got {self.num_stages!r}")
        for name in ("preload", "launch_early"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"GemmConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.launch_early and not self.preload:
            raise ValueError("GemmConfig.launch_early needs preload=True (the early launch follows the preload)")

    def k_per_split(self, k: int) -> int:
        """K columns per split: a whole number of BLOCK_K steps, so only the last split is ragged."""
        return triton.cdiv(triton.cdiv(k, self.split_k), self.block_k) * self.block_k

    def num_splits(self, k: int) -> int:
        return triton.cdiv(k, self.k_per_split(k))


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; 132 (an H200) on a CPU, so the interpreter sees GPU configs."""
    if device.type != "cuda":
        return 132
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def choose_config(m: int, n: int, k: int, kind: str = "full", sms: int = 132) -> GemmConfig:
    """The default GemmConfig for x [m, k] @ W[n, k].T; kind "full", "partials" or "silu" (n counts the
    merged gate and up rows). Aims at >= 2 programs per SM: column tiles of BLOCK_N rows, times K splits
    for "partials". Examples on an H200 (132 SMs): o_proj at M=1 (K=2048, N=1024): GEMV, 64 tiles of 16
    rows x 4 splits of 512 = 256 programs; qkv at M=1 (K=1024, N=4096): 256 tiles of 16 rows, full K."""
    if kind not in ("full", "partials", "silu"):
        raise ValueError(f"kind must be 'full', 'partials' or 'silu', got {kind!r}")
    if not 1 <= m <= MAX_M:
        raise ValueError(f"small GEMMs take 1 <= M <= {MAX_M} rows, got {m}")
    target = 2 * sms
    n_out = n // 2 if kind == "silu" else n
    if m <= GEMV_MAX_M:
        cfg = dict(block_m=triton.next_power_of_2(m), block_n=16, use_dot=False, num_stages=2, num_warps=4,
                   block_k=256 if kind == "partials" else 512)
    elif m <= TILE_M:
        wide = triton.cdiv(n_out, 32) >= target
        block_m = max(16, triton.next_power_of_2(m))
        # Round 11 (bench/results/kernels_round11_h100_2026-12-06.json, each projection timed in the 28-layer
        # decode GEMM chain at 4-64 rows): 32-column tiles at 4 warps for the SiLU epilogue (gate_up 1.1-3.8 us a
        # layer faster than 16 columns at 8 warps) and for the partial sums, whose K splits then aim at one
        # program an SM (o_proj and down 0.3-2.0 us faster than 16 columns at two programs an SM). The
        # full-K form (qkv) was level across the candidates and keeps its tiles.
        cfg = dict(block_m=block_m, block_n=32 if (wide or kind != "full") else 16, use_dot=True, num_stages=4,
                   block_k=128, num_warps=4)
        if kind == "partials":
            target = sms
    else:
        # More rows than one tile: tiles of TILE_M rows, and wider column tiles so that x (re-read from L2
        # by every column tile) stays a small part of the traffic.
        cfg = dict(block_m=TILE_M, block_n=64, use_dot=True, num_stages=4, block_k=64,
                   num_warps=8 if kind == "silu" else 4)
    cfg["block_k"] = min(cfg["block_k"], max(16, triton.next_power_of_2(k)))
    split = 1
    if kind == "partials":
        tiles = triton.cdiv(n_out, cfg["block_n"]) * triton.cdiv(m, cfg["block_m"])
        split = max(1, min(triton.cdiv(target, tiles), triton.cdiv(k, cfg["block_k"])))
    if preloads_weights(m):
        # Round 13 (bench/kernels_round13.py, the decode GEMM chain on an H100, 2026-12-07): at one row each program
        # takes its whole K range in one step (block_k = the split's length, up to 1,024 columns: 32 KB of weights
        # a tile of 16 rows) and asks for those weights before the PDL wait, so they stream in under the tail of
        # the kernel in front: 24.57 -> 22.90 us a layer. With tl.dot (2-64 rows) the preload made the chain
        # 8-21 % slower, so it stays off there.
        whole = triton.next_power_of_2(GemmConfig(split_k=split, **cfg).k_per_split(k))
        if whole <= 1024:
            cfg["block_k"] = max(cfg["block_k"], whole)
        return GemmConfig(split_k=split, preload=True, **cfg)
    return GemmConfig(split_k=split, **cfg)


def warm_batch_sizes(max_m: int = MAX_M) -> list[int]:
    """One batch size for each kernel variant `choose_config` picks for 1..max_m rows (its tile sizes, warps,
    stages and GEMV or dot; M itself is not specialised on): decode steps at these sizes compile every variant,
    e.g. in a start-up warm-up of eager decode. For max_m = 64: [1, 2, 17, 33]; 512: [1, 2, 17, 33, 65]."""
    seen, sizes = set(), []
    for m in range(1, max_m + 1):
        cfg = choose_config(m, 4096, 4096)
        key = (cfg.block_m, cfg.block_n, cfg.block_k, cfg.use_dot, cfg.num_warps, cfg.num_stages)
        if key not in seen:
            seen.add(key)
            sizes.append(m)
    return sizes


@triton.jit
def _accumulate(acc, x_ptr, stride_xm, w_rows, ks, k_mask, offs_m, m_mask, n_mask, M,
                BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr, CAST_FP32: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] += x[:, ks] @ W[rows, ks].T for one K step."""
    w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    return _accumulate_w(acc, w, x_ptr, stride_xm, ks, k_mask, offs_m, m_mask, M, BLOCK_M, USE_DOT, CAST_FP32,
                         DOT_PRECISION)


@triton.jit
def _accumulate_w(acc, w, x_ptr, stride_xm, ks, k_mask, offs_m, m_mask, M,
                  BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr, CAST_FP32: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """acc += x[:, ks] @ w.T for a weight tile w [BLOCK_N, BLOCK_K] already loaded (the preloaded first step)."""
    if USE_DOT:
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + ks[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if CAST_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    else:
        # W is read once per step and reused for every row of x (M is small): a broadcast multiply and
        # a sum along K per row, written into row m of the accumulator.
        # Rows m >= M (BLOCK_M is M rounded up) re-read row M - 1; their results are never stored.
        wf = w.to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            row = tl.minimum(M - 1, m)
            xm = tl.load(x_ptr + row * stride_xm + ks, mask=k_mask, other=0.0).to(tl.float32)
            part = tl.sum(wf * xm[None, :], axis=1)
            acc += tl.where(offs_m[:, None] == m, part[None, :], 0.0)
    return acc


@triton.jit(do_not_specialize=["M"])
def _small_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_os, stride_om, k_per_split, up_offset, up_rows,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, PARTIALS: tl.constexpr, SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr,
    CAST_FP32: tl.constexpr, EMULATE_ROUNDING: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr, PRELOAD: tl.constexpr, LAUNCH_EARLY: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = split * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    up_w_rows = w_rows + up_offset                   # SiLU: the up rows sit I rows below the gate
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PRELOAD:
        # The first K step's weight tiles are asked for before the wait: W is no output of the kernel in front,
        # so this HBM round trip runs under that kernel's tail instead of after it. x is its output: read after.
        ks = k_start + offs_k
        k_mask = ks < k_stop
        w_first = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if SILU_MUL:
            up_first = tl.load(up_w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if USE_PDL and LAUNCH_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        acc = _accumulate_w(acc, w_first, x_ptr, stride_xm, ks, k_mask, offs_m, m_mask, M,
                            BLOCK_M, USE_DOT, CAST_FP32, DOT_PRECISION)
        if SILU_MUL:
            acc_up = _accumulate_w(acc_up, up_first, x_ptr, stride_xm, ks, k_mask, offs_m, m_mask, M,
                                   BLOCK_M, USE_DOT, CAST_FP32, DOT_PRECISION)
        k_loop = k_start + BLOCK_K
    else:
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        k_loop = k_start
    for k0 in range(k_loop, k_stop, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < k_stop
        acc = _accumulate(acc, x_ptr, stride_xm, w_rows, ks, k_mask, offs_m, m_mask, n_mask, M,
                          BLOCK_M, USE_DOT, CAST_FP32, DOT_PRECISION)
        if SILU_MUL:
            acc_up = _accumulate(acc_up, x_ptr, stride_xm, up_w_rows, ks, k_mask, offs_m, m_mask, n_mask, M,
                                 BLOCK_M, USE_DOT, CAST_FP32, DOT_PRECISION)
    if USE_PDL and not LAUNCH_EARLY:
        # Not at the start: a trial that let the next kernel launch there made back-to-back tl.dot GEMMs
        # 1.5-1.7x slower with PDL than without it on the H200 (M = 8-64,
        # bench/results/kernels_round5_h200_2026-12-02.json).
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_BIAS:                                      # added once: by split 0 of the partial sums
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc += tl.where(split == 0, bias, 0.0)[None, :]
        if SILU_MUL:
            acc_up += tl.load(bias_ptr + up_rows + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    rows = offs_m.to(tl.int64)[:, None] * stride_om
    if PARTIALS:
        tl.store(out_ptr + split * stride_os + rows + offs_n[None, :], acc, mask=out_mask)
    else:
        dtype = out_ptr.dtype.element_ty
        y = round_to(acc, dtype, EMULATE_ROUNDING)                 # the GEMM output in the model dtype
        if SILU_MUL:
            up = round_to(acc_up, dtype, EMULATE_ROUNDING)
            y = round_to(y * tl.sigmoid(y), dtype, EMULATE_ROUNDING)   # F.silu writes the model dtype
            y = round_to(y * up, dtype, EMULATE_ROUNDING)
        tl.store(out_ptr + rows + offs_n[None, :], y.to(dtype), mask=out_mask)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemmConfig | None):
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"small GEMMs take 1 <= M <= {MAX_M} rows, got M={x.shape[0]} (use F.linear)")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"x ({x.dtype}), weight ({weight.dtype}) and bias must share a dtype")
    if x.device != weight.device or (bias is not None and bias.device != x.device):
        raise ValueError("x, weight and bias must be on one device")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need stride(1) == 1 (K contiguous)")
    if bias is not None and (bias.dim() != 1 or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous vector, got shape {tuple(bias.shape)}")
    if config is not None and not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a GemmConfig or None, got {type(config).__name__}")
    if config is not None and config.use_dot and not interpreting() and \
            min(config.block_m, config.block_n, config.block_k) < 16:
        raise ValueError(f"tl.dot needs tiles >= 16 on a GPU, got {config}")
    if config is not None and not config.use_dot and config.block_m < x.shape[0]:
        raise ValueError(f"config.block_m={config.block_m} is smaller than M={x.shape[0]} (the GEMV form "
                         "takes every row in one tile)")


def _launch(x, weight, bias, out, n_out, config, partials, silu, use_pdl):
    m, k = x.shape
    num_splits = config.num_splits(k) if partials else 1
    grid = (triton.cdiv(n_out, config.block_n), num_splits, triton.cdiv(m, config.block_m))
    _small_gemm_kernel[grid](
        x, weight, bias if bias is not None else out, out,
        m, n_out, k, x.stride(0), weight.stride(0), out.stride(0) if partials else 0, out.stride(-2),
        config.k_per_split(k) if partials else k, n_out * weight.stride(0) if silu else 0, n_out if silu else 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, USE_DOT=config.use_dot,
        PARTIALS=partials, SILU_MUL=silu, HAS_BIAS=bias is not None, CAST_FP32=interpreting(),
        EMULATE_ROUNDING=interpreting(),
        DOT_PRECISION="ieee" if (x.dtype == torch.float32 or interpreting()) else "tf32",
        USE_PDL=use_pdl, PRELOAD=config.preload, LAUNCH_EARLY=config.launch_early,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch_kwargs(use_pdl),
    )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: GemmConfig | None = None, use_pdl: bool = False) -> torch.Tensor:
    """y = x @ weight.T + bias for a small batch, in one kernel over the full K.

    x: [M, K] with 1 <= M <= 512, weight: [N, K], bias: [N] or None, one dtype (bf16, fp16 or fp32), K
    contiguous. config: a GemmConfig, or None for `choose_config(M, N, K, "full")`.
    Returns y: [M, N] in x's dtype. Raises ValueError on shapes, dtypes or devices that disagree."""
    _check(x, weight, bias, config)
    config = config or choose_config(x.shape[0], weight.shape[0], x.shape[1], "full", num_sms(x.device))
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    return _launch(x, weight, bias, out, weight.shape[0], config, False, False, use_pdl)


def linear_partials(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    config: GemmConfig | None = None, use_pdl: bool = False) -> torch.Tensor:
    """Split-K partial sums of x @ weight.T (+ bias, added to split 0 only): P [S, M, N] fp32 with
    sum_s P[s] = x @ weight.T + bias. S = config.num_splits(K) (config None: `choose_config(..., "partials")`).
    The consumer adds the S slices (kernels/rms_norm.add_rms_norm); under tensor parallelism an all-reduce of
    P over the ranks keeps that sum right. Shapes and errors as `linear`."""
    _check(x, weight, bias, config)
    m, k = x.shape
    config = config or choose_config(m, weight.shape[0], k, "partials", num_sms(x.device))
    out = torch.empty((config.num_splits(k), m, weight.shape[0]), dtype=torch.float32, device=x.device)
    return _launch(x, weight, bias, out, weight.shape[0], config, True, False, use_pdl)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    config: GemmConfig | None = None, use_pdl: bool = False) -> torch.Tensor:
    """silu(x @ W_gate.T) * (x @ W_up.T) in one kernel, W = weight = [W_gate; W_up] ([2I, K], the merged
    gate_up projection; bias [2I] likewise). Returns [M, I] in x's dtype; each step rounds to the model
    dtype as the unfused GEMM + layers/activation.silu_and_mul do. Raises ValueError if weight has an odd
    number of rows; otherwise as `linear`."""
    _check(x, weight, bias, config)
    if weight.shape[0] % 2:
        raise ValueError(f"the merged gate_up weight needs an even number of rows, got {weight.shape[0]}")
    config = config or choose_config(x.shape[0], weight.shape[0], x.shape[1], "silu", num_sms(x.device))
    inter = weight.shape[0] // 2
    out = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
    return _launch(x, weight, bias, out, inter, config, False, True, use_pdl)
