"""Sizing and allocating the paged KV cache (chapters 04 and 10).

One tensor holds every layer's keys and values: [2, num_layers, num_blocks, block_size, Hkv, D]. Each
Attention layer gets views of its slice (k_cache, v_cache: [num_blocks, block_size, Hkv, D]). On a GPU the
number of blocks is what fits in `gpu_memory_utilization` of the memory after the weights and the peak
activations of a warm-up step; on a CPU it is `cpu_kvcache_space_gib`. Upstream nano-vllm:
`ModelRunner.allocate_kv_cache`.
"""
import math

import torch
import torch.distributed as dist


def kv_block_bytes(layers, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all `layers` (Attention modules): K and V, block_size tokens each."""
    a = layers[0]
    return 2 * len(layers) * block_size * a.num_kv_heads * a.head_dim * dtype.itemsize


def kv_budget_bytes(config, device_type: str) -> int:
    """Bytes the cache may use: on CUDA, gpu_memory_utilization of the total minus what is in use and the
    warm-up's activation peak (which must stay available); on CPU, cpu_kvcache_space_gib."""
    if device_type != "cuda":
        return int(config.cpu_kvcache_space_gib * 2**30)
    free, total = torch.cuda.mem_get_info()
    stats = torch.cuda.memory_stats()
    peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
    return int(total * config.gpu_memory_utilization) - (total - free) - peak + current


def plan_num_blocks(config, block_bytes: int, budget: int, world_size: int, device) -> int:
    """How many blocks to allocate: config.num_kvcache_blocks when > 0 (ValueError if it does not fit),
    else as many as fit, but no more than max_num_seqs full-length sequences can use. With several
    tensor-parallel ranks, all agree on the smallest. Raises ValueError if not even one block fits."""
    fit = max(budget, 0) // block_bytes
    if config.num_kvcache_blocks > 0:
        if config.num_kvcache_blocks > fit:
            raise ValueError(f"num_kvcache_blocks={config.num_kvcache_blocks} needs "
                             f"{config.num_kvcache_blocks * block_bytes / 2**20:.1f} MiB but only "
                             f"{max(budget, 0) / 2**20:.1f} MiB is available for the KV cache")
        num_blocks = config.num_kvcache_blocks
    else:
        blocks_per_seq = (config.max_model_len + config.kvcache_block_size - 1) // config.kvcache_block_size
        num_blocks = min(fit, config.max_num_seqs * blocks_per_seq)
    if world_size > 1:                        # every rank must agree, or block ids would differ
        t = torch.tensor([num_blocks], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        num_blocks = int(t.item())
    if num_blocks < 1:
        raise ValueError(f"too little memory for one KV-cache block ({block_bytes / 2**20:.2f} MiB per "
                         f"block of {config.kvcache_block_size} tokens, {max(budget, 0) / 2**20:.2f} MiB "
                         "available); raise gpu_memory_utilization / cpu_kvcache_space_gib or lower "
                         "kvcache_block_size")
    return num_blocks


def allocate_kv_cache(layers, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Allocate [2, num_layers, num_blocks, block_size, Hkv, D] zeros and point each layer's k_cache and
    v_cache at its slice. Returns the whole tensor."""
    a = layers[0]
    shape = (2, len(layers), num_blocks, block_size, a.num_kv_heads, a.head_dim)
    if torch.device(device).type == "cpu":
        cache = cpu_zeros(shape, dtype)
    else:
        cache = torch.zeros(shape, dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
    return cache


def cpu_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """`torch.zeros(shape, dtype=dtype)` on CPU, without writing the memory first. torch.zeros fills what it
    allocates, which page-faults every page of the cache at start-up (1 GiB, the default CPU budget: 1.4 to 2.9 s
    on the course's 2-core machine). A private anonymous mapping is zeros as the OS hands it out, page by page
    when first touched, so a block costs its page faults once it is used. The same zeros, page-aligned, in a
    storage of exactly the tensor's bytes; the tensor keeps the mapping alive. (torch.zeros where there is no
    mmap.MAP_PRIVATE.)"""
    import mmap
    nbytes = math.prod(shape) * dtype.itemsize
    if not hasattr(mmap, "MAP_PRIVATE") or nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
