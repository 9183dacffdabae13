"""Weights into L2 ahead of the GEMM that reads them, from a second stream (issue 29 round 10; bench only).

Measured on the H200 and not kept (bench/results/README.md, round 10): at 1 row the side-stream prefetch made
the 28-layer GEMM chain slower (22.3 -> 25.3-27.1 us a layer), at 4-64 rows 3-5 % faster, at 128-256 rows
slower. So it lives here, for bench/kernels_round10.py, and the engine does not use it.

Why
    A decode step of a few rows is a chain of dependent kernels, and each GEMM in it streams its weights from
    HBM: at batch 1 the four GEMMs of a Qwen3-0.6B layer read 31.5 MB in about 24 us where the copy bandwidth
    allows 7.5 (bench/results/README.md, round 6). One kernel cannot keep enough requests in flight in the few
    microseconds it runs. But the weights do not depend on anything the step computes, so their read need not
    wait for the kernel in front: a small kernel on a second stream asks for the next GEMM's weights while the
    current one runs, and the GEMM then finds them in L2 (50 MB on an H100/H200).

What it does
    `prefetch_l2(t)` asks for the bytes of the contiguous tensor `t` into L2 and returns at once. Each lane of
    the grid issues one PTX `cp.async.bulk.prefetch.L2.global` of CHUNK bytes (sm_90's bulk copy engine: one
    instruction, no registers, no wait), or with `bulk=False` one `prefetch.global.L2` a 128-byte line. It is a
    hint: no value changes whether it runs, runs late or is evicted before use, so it needs no ordering against
    the GEMM it serves. GPU only (inline PTX; the interpreter cannot run it).

`L2Prefetcher` is what the chain's GEMMs share: `ahead(weight)` launches the prefetch of `weight` on its side
stream, after the work queued so far on the current stream, and `join()` makes the current stream wait for the
side stream (a CUDA graph capture must end with every forked stream joined). The chain calls `ahead` with the
weight of the GEMM after the current one, just before the current one runs (bench/kernels_round10.py).
"""
import torch
import triton
import triton.language as tl

CHUNK = 16384            # bytes one lane asks for (bulk form); a multiple of 16, as cp.async.bulk needs
LANES = 32               # one warp a program
LINE = 128               # bytes of one L2 line request (line form)


@triton.jit
def _bulk_prefetch(ptrs, sizes):
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [ptrs, sizes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _line_prefetch(ptrs):
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(ptr, nbytes, CHUNK_BYTES: tl.constexpr, LANES_: tl.constexpr, BULK: tl.constexpr,
                        LINES_A_LANE: tl.constexpr):
    pid = tl.program_id(0)
    base = ptr.to(tl.pointer_type(tl.int8))
    lanes = tl.arange(0, LANES_)
    if BULK:
        start = (pid * LANES_ + lanes).to(tl.int64) * CHUNK_BYTES
        # the last chunk is cut to what is left (rounded down to 16 bytes: the tail of a hint may be dropped)
        size = (tl.minimum(nbytes - start, CHUNK_BYTES) // 16 * 16).to(tl.int32)
        keep = size > 0
        _bulk_prefetch(base + tl.where(keep, start, 0), tl.where(keep, size, 16))
    else:
        for i in tl.static_range(LINES_A_LANE):
            start = ((pid * LINES_A_LANE + i) * LANES_ + lanes).to(tl.int64) * 128
            _line_prefetch(base + tl.minimum(start, nbytes - 1))


def prefetch_l2(t: torch.Tensor, bulk: bool = True, lines_a_lane: int = 8) -> None:
    """Ask for the bytes of `t` (a contiguous CUDA tensor, any dtype, 16-byte aligned for `bulk`) into L2, on the
    current stream; returns at once, changes no value. Raises ValueError for a CPU or non-contiguous tensor."""
    if t.device.type != "cuda":
        raise ValueError(f"prefetch_l2 needs a CUDA tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError("prefetch_l2 needs a contiguous tensor (it asks for one byte range)")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return
    if bulk:
        if t.data_ptr() % 16:
            raise ValueError("prefetch_l2(bulk=True) needs a 16-byte aligned tensor")
        grid = (triton.cdiv(nbytes, CHUNK * LANES),)
    else:
        grid = (triton.cdiv(nbytes, LINE * LANES * lines_a_lane),)
    _l2_prefetch_kernel[grid](t, nbytes, CHUNK_BYTES=CHUNK, LANES_=LANES, BULK=bulk, LINES_A_LANE=lines_a_lane,
                              num_warps=1)


class L2Prefetcher:
    """A side stream that fetches weights into L2 while the current stream computes (module docstring).

    bulk: the bulk-copy form (default) or 128-byte line requests. One prefetcher serves one model on one device;
    `ahead` and `join` must be called on that device's current stream, in or out of CUDA-graph capture."""

    def __init__(self, device: torch.device, bulk: bool = True):
        if device.type != "cuda":
            raise ValueError(f"L2Prefetcher needs a CUDA device, got {device}")
        self.device = device
        self.bulk = bulk
        self.stream = torch.cuda.Stream(device=device)
        self._forked = False

    def ahead(self, weight: torch.Tensor) -> None:
        """Prefetch `weight` on the side stream once the current stream's queued work has started it off."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            prefetch_l2(weight, bulk=self.bulk)
        self._forked = True

    def join(self) -> None:
        """The current stream waits for every prefetch asked so far (a no-op when none was)."""
        if self._forked:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self._forked = False
