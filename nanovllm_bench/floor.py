"""The physical floor of a workload: the least time any engine needs on a machine (chapter 11).

Decode must read every cached K/V once per step, every decode step reads the weights once, and prefill does
2 * params FLOPs per token plus attention. With the machine's copy bandwidth `bw` (bytes/s, read + write)
and matmul rate `flops_s`:
    floor_s = KV bytes / bw + steps * weight bytes / bw + prefill FLOPs / flops_s.
A run is reported as % of that floor (`pct_of_floor`), against the floor of the GPUs it used.
"""


def model_stats(hf_config) -> dict:
    """Parameter and byte counts of a decoder-only config (bf16: 2 bytes per weight and per K/V element)."""
    h, L = hf_config.hidden_size, hf_config.num_hidden_layers
    hd = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    H, Hkv, I, V = hf_config.num_attention_heads, hf_config.num_key_value_heads, hf_config.intermediate_size, hf_config.vocab_size
    per_layer = h * (H + 2 * Hkv) * hd + H * hd * h + 3 * h * I
    params = L * per_layer + V * h * (1 if hf_config.tie_word_embeddings else 2)
    return dict(params=params, layer_params=L * per_layer, kv_bytes_per_token=2 * L * Hkv * hd * 2,
                attn_flops_coef=4 * L * H * hd, weight_bytes=2 * params, lm_head_params=V * h)


def physical_floor(prompts, max_tokens, stats, bw_bytes_s, flops_s) -> dict:
    """Seconds the workload needs at least, on a machine with copy bandwidth bw and matmul rate flops_s."""
    kv_tok = stats["kv_bytes_per_token"]
    # Decode token t (1 .. M-1; token 0 comes from prefill) attends over P + t cached positions.
    kv_bytes = sum(kv_tok * ((m - 1) * len(p) + (m - 1) * m // 2) for p, m in zip(prompts, max_tokens))
    steps = max(max_tokens) - 1                     # all requests decode together; the longest sets the count
    weight_bytes = steps * stats["weight_bytes"]
    lens = [len(p) for p in prompts]
    prefill_flops = 2 * (stats["layer_params"]) * sum(lens) + 2 * stats["lm_head_params"] * len(lens) \
        + stats["attn_flops_coef"] * sum(n * n / 2 for n in lens)
    parts = dict(kv_read_s=kv_bytes / bw_bytes_s, weight_read_s=weight_bytes / bw_bytes_s,
                 prefill_s=prefill_flops / flops_s)
    parts["floor_s"] = sum(parts.values())
    parts.update(kv_bytes=kv_bytes, weight_bytes=weight_bytes, prefill_flops=prefill_flops)
    return parts


def pct_of_floor(floor_s: float, seconds: float, gpus: int = 1) -> float:
    """A run's time as % of the physical floor of the GPUs it used. `floor_s` is one GPU's floor (seconds);
    `gpus` GPUs read the weights and K/V in parallel (tensor parallel), so theirs is floor_s / gpus."""
    return 100 * floor_s / gpus / seconds
