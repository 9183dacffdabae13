"""Mutation tests of the chapter 03-05 check helpers (nanovllm_course/ch03.py, ch04.py, ch05.py).

Each check must pass on the reference (printing exactly its one `E<n>.<m> ok` line), fail on a stub that
raises NotImplementedError (with 'not implemented yet'), and fail on planted plausible mistakes with a
message that points at the mistake.
"""
import types
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from course_checks import fails, passes, stub
from nanovllm_ref.attn import torch_backend
from nanovllm_course import ch03, ch04, ch05
from nanovllm_ref.engine.block_manager import BlockManager, compute_block_hash
from nanovllm_ref.layers.attention import store_kvcache_torch
from nanovllm_ref.models.qwen3 import DecoderAttention, DecoderMLP
from nanovllm_ref.utils.context import AttentionMetadata, attention_metadata


# == chapter 03 =============================================================================================

def gqa_ref(q, k, v, scale):
    return ch03.reference_gqa_attention(q, k, v, scale)


def gqa_noncausal(q, k, v, scale):
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
                                          v.repeat_interleave(group, 1).transpose(0, 1), scale=scale).transpose(0, 1)


def gqa_repeat_not_interleave(q, k, v, scale):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat(1, group, 1), v.repeat(1, group, 1)
    return ch03.reference_gqa_attention(q, k, v, scale)


def gqa_no_scale(q, k, v, scale):
    return ch03.reference_gqa_attention(q, k, v, 1.0)


def attn_ref(attn, positions, x):
    return DecoderAttention.forward(attn, positions, x)


def attn_norm_after_rope(attn, positions, x):
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.reshape(-1, attn.num_heads, attn.head_dim)
    k = k.reshape(-1, attn.num_kv_heads, attn.head_dim)
    q, k = attn.rotary_emb(positions, q, k)
    q, k = attn.q_norm(q), attn.k_norm(k)
    return attn.o_proj(attn.attn(q.flatten(1), k.flatten(1), v))


def attn_split_qvk(attn, positions, x):
    q, v, k = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = attn.q_norm(q.reshape(-1, attn.num_heads, attn.head_dim))
    k = attn.k_norm(k.reshape(-1, attn.num_kv_heads, attn.head_dim))
    q, k = attn.rotary_emb(positions, q, k)
    return attn.o_proj(attn.attn(q.flatten(1), k.flatten(1), v))


def attn_no_norm(attn, positions, x):
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q, k = attn.rotary_emb(positions, q.reshape(-1, attn.num_heads, attn.head_dim),
                           k.reshape(-1, attn.num_kv_heads, attn.head_dim))
    return attn.o_proj(attn.attn(q.flatten(1), k.flatten(1), v))


def mlp_ref(mlp, x):
    return DecoderMLP.forward(mlp, x)


def mlp_swapped(mlp, x):
    gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
    return mlp.down_proj(F.silu(up) * gate)


def qkv_ref(param, w, shard_id, q_size, kv_size):
    offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
    param.data[offset:offset + size] = w


def qkv_kv_swapped(param, w, shard_id, q_size, kv_size):
    offset, size = {"q": (0, q_size), "v": (q_size, kv_size), "k": (q_size + kv_size, kv_size)}[shard_id]
    param.data[offset:offset + size] = w


def qkv_bad_offset(param, w, shard_id, q_size, kv_size):
    offset = {"q": 0, "k": kv_size, "v": 2 * kv_size}[shard_id]
    param.data[offset:offset + w.shape[0]] = w


def gate_up_ref(param, w, shard_id, inter):
    param.data[shard_id * inter:(shard_id + 1) * inter] = w


def gate_up_swapped(param, w, shard_id, inter):
    param.data[(1 - shard_id) * inter:(2 - shard_id) * inter] = w


def make_build_model(qkv_loader=qkv_ref, gate_up_loader=gate_up_ref, gqa=gqa_ref):
    from transformers import AutoConfig
    from nanovllm_ref.models.qwen3 import Qwen3ForCausalLM
    from nanovllm_ref.utils.loader import load_model

    def varlen_prefill(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        b = cu_q.tolist()
        return torch.cat([gqa(q[s:e], k[s:e], v[s:e], scale) for s, e in zip(b[:-1], b[1:])])

    def build_model(model_dir):
        model = Qwen3ForCausalLM(AutoConfig.from_pretrained(model_dir))
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.forward = types.MethodType(attn_ref, attn)
            mlp.forward = types.MethodType(mlp_ref, mlp)
            attn.qkv_proj.weight.weight_loader = lambda p, w, s, a=attn: qkv_loader(p, w, s, a.q_size, a.kv_size)
            mlp.gate_up_proj.weight.weight_loader = (
                lambda p, w, s, m=mlp: gate_up_loader(p, w, s, m.gate_up_proj.output_sizes[0]))
            attn.attn.backend = SimpleNamespace(varlen_prefill=varlen_prefill)
        load_model(model, model_dir)
        return model.eval()
    return build_model


def make_prefill_logits(global_positions=False, one_sequence=False, first_token=False, per_prompt_forward=False):
    def prefill_logits(model, prompts):
        if per_prompt_forward and len(prompts) > 1:     # right logits, but one forward per prompt
            return torch.cat([prefill_logits(model, [p]) for p in prompts])
        ids = torch.tensor([t for p in prompts for t in p])
        pos = torch.arange(len(ids)) if global_positions else torch.tensor([i for p in prompts for i in range(len(p))])
        lens = [len(ids)] if one_sequence else [len(p) for p in prompts]
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        meta = AttentionMetadata(is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                                 max_seqlen_k=max(lens))
        with attention_metadata(meta):
            hidden = model(ids, pos)
        ends = torch.tensor([len(p) for p in prompts]).cumsum(0)
        rows = ends - torch.tensor([len(p) for p in prompts]) if first_token else ends - 1
        return model.compute_logits(hidden[rows])
    return prefill_logits


def no_backend_build(model_dir):
    from transformers import AutoConfig
    from nanovllm_ref.models.qwen3 import Qwen3ForCausalLM
    from nanovllm_ref.utils.loader import load_model
    model = Qwen3ForCausalLM(AutoConfig.from_pretrained(model_dir))
    load_model(model, model_dir)
    return model


def unloaded_build(model_dir):
    from transformers import AutoConfig
    from nanovllm_ref.models.qwen3 import Qwen3ForCausalLM
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(AutoConfig.from_pretrained(model_dir))
    for p in model.parameters():
        p.data.normal_()
    for m in model.modules():
        if hasattr(m, "backend"):
            m.backend = torch_backend
    return model


def test_reference_answers(capsys):
    passes(ch03.check_decoder_blocks, ch03.reference_attention_forward, ch03.reference_mlp_forward, tag="E3.2",
           capsys=capsys)
    passes(ch03.check_packed_loaders, ch03.reference_qkv_weight_loader, ch03.reference_gate_up_weight_loader,
           tag="E3.3", capsys=capsys)
    passes(ch04.check_paged_decode, ch04.reference_paged_decode, tag="E4.2", capsys=capsys)
    passes(ch04.check_store_kvcache, ch04.reference_store_kvcache, tag="E4.3", capsys=capsys)
    passes(ch05.check_compute_block_hash, ch05.reference_compute_block_hash, tag="E5.1", capsys=capsys)
    passes(ch05.check_prefix_caching, ch05.ReferenceBlockManager, tag="E5.3", capsys=capsys)


def test_e3_1(capsys):
    passes(ch03.check_gqa_attention, gqa_ref, tag="E3.1", capsys=capsys)
    fails(ch03.check_gqa_attention, stub, match="not implemented yet")
    fails(ch03.check_gqa_attention, gqa_noncausal, match="causal mask")
    fails(ch03.check_gqa_attention, gqa_repeat_not_interleave, match="GQA")
    fails(ch03.check_gqa_attention, gqa_no_scale, match="scale")


def test_e3_2(capsys):
    passes(ch03.check_decoder_blocks, attn_ref, mlp_ref, tag="E3.2", capsys=capsys)
    fails(ch03.check_decoder_blocks, stub, mlp_ref, match="not implemented yet")
    fails(ch03.check_decoder_blocks, attn_ref, stub, match="not implemented yet")
    fails(ch03.check_decoder_blocks, attn_norm_after_rope, mlp_ref, match="before\\* RoPE")
    fails(ch03.check_decoder_blocks, attn_split_qvk, mlp_ref, match="q \\| k \\| v")
    fails(ch03.check_decoder_blocks, attn_no_norm, mlp_ref, match="q_norm")
    fails(ch03.check_decoder_blocks, attn_ref, mlp_swapped, match="first half")


def test_e3_3(capsys):
    passes(ch03.check_packed_loaders, qkv_ref, gate_up_ref, tag="E3.3", capsys=capsys)
    fails(ch03.check_packed_loaders, stub, gate_up_ref, match="not implemented yet")
    fails(ch03.check_packed_loaders, qkv_ref, stub, match="not implemented yet")
    fails(ch03.check_packed_loaders, qkv_kv_swapped, gate_up_ref,
          match="where shard 'k' belongs, hold the weights of shard 'v'")
    fails(ch03.check_packed_loaders, qkv_bad_offset, gate_up_ref, match="qkv_proj")
    fails(ch03.check_packed_loaders, qkv_ref, gate_up_swapped, match="gate_up_proj")


def qkv_rebuilt(param, loaded_weight, shard_id, q_size, kv_size):
    """Right rows, but param.data is rebound to a new tensor (torch.cat) instead of written in place."""
    offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
    param.data = torch.cat([param.data[:offset], loaded_weight.to(param.dtype), param.data[offset + size:]])


def gate_up_in_checkpoint_dtype(param, loaded_weight, shard_id, intermediate_size):
    """Rebinds the parameter to the checkpoint's dtype when they differ."""
    if param.dtype != loaded_weight.dtype:
        param.data = param.data.to(loaded_weight.dtype)
    param.data.narrow(0, shard_id * intermediate_size, intermediate_size).copy_(loaded_weight)


def test_e3_3_loaders_must_keep_the_parameter():
    for _ in range(3):
        fails(ch03.check_packed_loaders, qkv_rebuilt, gate_up_ref, match="no longer uses its own memory")
        fails(ch03.check_packed_loaders, qkv_ref, gate_up_in_checkpoint_dtype, match="after loading, the parameter is")


def test_e3_4(capsys):
    passes(ch03.check_prefill_logits, make_prefill_logits(), make_build_model(), tag="E3.4", capsys=capsys)
    fails(ch03.check_prefill_logits, stub, make_build_model(), match="not implemented yet")
    fails(ch03.check_prefill_logits, make_prefill_logits(), make_build_model(qkv_loader=stub),
          match="not implemented yet")
    fails(ch03.check_prefill_logits, make_prefill_logits(), make_build_model(qkv_loader=qkv_kv_swapped),
          match="wrong weights in .*qkv_proj")
    # Positions counted over the whole batch instead of per prompt give the same logits (RoPE only sees
    # position differences inside a sequence), so the check looks at the positions handed to the model.
    msg = fails(ch03.check_prefill_logits, make_prefill_logits(global_positions=True), make_build_model(),
                match="the positions handed to the model")
    assert "restart at 0 for each prompt" in msg
    fails(ch03.check_prefill_logits, make_prefill_logits(per_prompt_forward=True), make_build_model(),
          match="ran the model 3 times")
    # An Attention layer built without a back-end uses the torch one (the engine's default), so this is right.
    passes(ch03.check_prefill_logits, make_prefill_logits(), no_backend_build, tag="E3.4", capsys=capsys)
    fails(ch03.check_prefill_logits, make_prefill_logits(), unloaded_build, match="wrong weights")
    passes(ch03.check_prefill_logits, ch03.reference_prefill_logits, ch03.reference_build_model, tag="E3.4",
           capsys=capsys)
    fails(ch03.check_prefill_logits, make_prefill_logits(one_sequence=True), make_build_model(),
          match="cu_seqlens")
    fails(ch03.check_prefill_logits, make_prefill_logits(first_token=True), make_build_model(),
          match="last\\* token")
    fails(ch03.check_prefill_logits, make_prefill_logits(), make_build_model(gqa=gqa_noncausal),
          match="differ from HF")


# == chapter 04 =============================================================================================

def slots_ref(block_table, start, end, block_size):
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def slots_tensor(block_table, start, end, block_size):
    p = torch.arange(start, end)
    return torch.tensor(block_table, dtype=torch.long)[p // block_size] * block_size + p % block_size


def slots_off_by_one(block_table, start, end, block_size):
    return [block_table[p // block_size] * block_size + p % block_size + 1 for p in range(start, end)]


def slots_no_wrap(block_table, start, end, block_size):
    return [block_table[0] * block_size + p for p in range(start, end)]


def slots_no_multiply(block_table, start, end, block_size):
    return [block_table[p // block_size] + p % block_size for p in range(start, end)]


def slots_chunk_relative(block_table, start, end, block_size):
    return [block_table[i // block_size] * block_size + i % block_size for i in range(end - start)]


def slots_end_inclusive(block_table, start, end, block_size):
    return [block_table[p // block_size] * block_size + p % block_size
            for p in range(start, min(end + 1, len(block_table) * block_size))]


def decode_ignores_lens(q, k_cache, v_cache, block_tables, context_lens, scale):
    full = torch.full_like(context_lens, block_tables.shape[1] * k_cache.shape[1])
    return torch_backend.paged_decode(q, k_cache, v_cache, block_tables, full, scale)


def decode_gqa_modulo(q, k_cache, v_cache, block_tables, context_lens, scale):
    B, H, D = q.shape
    Hkv = k_cache.shape[2]
    table = block_tables.long().clamp(min=0)
    k = k_cache[table].reshape(B, -1, Hkv, D).float().repeat(1, 1, H // Hkv, 1)     # head h -> h % Hkv
    v = v_cache[table].reshape(B, -1, Hkv, D).float().repeat(1, 1, H // Hkv, 1)
    scores = torch.einsum("bhd,bthd->bht", q.float(), k) * scale
    valid = torch.arange(k.shape[1])[None, :] < context_lens[:, None]
    probs = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), -1)
    return torch.einsum("bht,bthd->bhd", probs, v).to(q.dtype)


def decode_lens_minus_one(q, k_cache, v_cache, block_tables, context_lens, scale):
    return torch_backend.paged_decode(q, k_cache, v_cache, block_tables, (context_lens - 1).clamp(min=1), scale)


def decode_returns_fp32(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Plausible but wrong: returns fp32 for every input."""
    return torch_backend.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale).float()


def decode_bf16_compute(q, k_cache, v_cache, block_tables, context_lens, scale):
    """The solution without its .float() calls: scores, softmax and weighted sum in the input dtype."""
    B, H, D = q.shape
    Hkv = k_cache.shape[2]
    table = block_tables.long().clamp(min=0)
    k = k_cache[table].reshape(B, -1, Hkv, D).repeat_interleave(H // Hkv, dim=2)
    v = v_cache[table].reshape(B, -1, Hkv, D).repeat_interleave(H // Hkv, dim=2)
    scores = torch.einsum("bhd,bthd->bht", q, k) * scale
    valid = torch.arange(k.shape[1])[None, :] < context_lens[:, None]
    probs = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(dim=-1)
    return torch.einsum("bht,bthd->bhd", probs, v)


def decode_bf16_manual_softmax(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Per sequence and head, exp(s - max) / sum in the input dtype."""
    B, H, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(B):
        n = int(context_lens[b])
        blocks = block_tables[b, :(n + bs - 1) // bs].long()
        k = k_cache[blocks].reshape(-1, Hkv, D)[:n]
        v = v_cache[blocks].reshape(-1, Hkv, D)[:n]
        for h in range(H):
            s = (k[:, h * Hkv // H] @ q[b, h]) * scale
            e = torch.exp(s - s.max())
            out[b, h] = (e / e.sum()) @ v[:, h * Hkv // H]
    return out


def decode_fp32_loop(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Right: a different fp32 formulation (loop, manual softmax), output cast back at the end."""
    B, H, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(B):
        n = int(context_lens[b])
        blocks = block_tables[b, :(n + bs - 1) // bs].long()
        k = k_cache[blocks].reshape(-1, Hkv, D)[:n].float()
        v = v_cache[blocks].reshape(-1, Hkv, D)[:n].float()
        for h in range(H):
            s = (k[:, h * Hkv // H] @ q[b, h].float()) * scale
            e = torch.exp(s - s.max())
            out[b, h] = ((e / e.sum()) @ v[:, h * Hkv // H]).to(q.dtype)
    return out


def decode_bf16_probs(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Acceptable (what FlashAttention does): fp32 scores and softmax, weights rounded to bf16 for P @ V."""
    B, H, D = q.shape
    Hkv = k_cache.shape[2]
    table = block_tables.long().clamp(min=0)
    k = k_cache[table].reshape(B, -1, Hkv, D).repeat_interleave(H // Hkv, dim=2).float()
    v = v_cache[table].reshape(B, -1, Hkv, D).repeat_interleave(H // Hkv, dim=2)
    scores = torch.einsum("bhd,bthd->bht", q.float(), k) * scale
    valid = torch.arange(k.shape[1])[None, :] < context_lens[:, None]
    probs = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(dim=-1)
    return torch.einsum("bht,bthd->bhd", probs.to(v.dtype).float(), v.float()).to(q.dtype)


def store_writes_minus_one(key, value, k_cache, v_cache, slot_mapping):
    slots = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value


def store_swapped(key, value, k_cache, v_cache, slot_mapping):
    store_kvcache_torch(value, key, k_cache, v_cache, slot_mapping)


def store_not_in_place(key, value, k_cache, v_cache, slot_mapping):
    keep = slot_mapping >= 0
    k_cache = k_cache.clone()
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping[keep].long()] = key[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping[keep].long()] = value[keep]


def test_e4_1(capsys):
    passes(ch04.check_slot_mapping, slots_ref, tag="E4.1", capsys=capsys)
    passes(ch04.check_slot_mapping, slots_tensor, tag="E4.1", capsys=capsys)
    fails(ch04.check_slot_mapping, stub, match="not implemented yet")
    fails(ch04.check_slot_mapping, slots_off_by_one, match="off by one")
    fails(ch04.check_slot_mapping, slots_no_wrap, match="wrap to the next block")
    fails(ch04.check_slot_mapping, slots_no_multiply, match="multiply the block id")
    fails(ch04.check_slot_mapping, slots_chunk_relative, match="absolute position")
    fails(ch04.check_slot_mapping, slots_end_inclusive, match="end is excluded")


def test_reference_slot_mapping_is_the_engines():
    assert ch04.reference_slot_mapping([7, 2], 0, 6, 4) == [28, 29, 30, 31, 8, 9]
    assert ch04.reference_slot_mapping([7, 2], 5, 6, 4) == [9]
    assert ch04.reference_slot_mapping([3, 0, 5], 3, 9, 3) == [0, 1, 2, 15, 16, 17]


def test_e4_2(capsys):
    passes(ch04.check_paged_decode, torch_backend.paged_decode, tag="E4.2", capsys=capsys)
    fails(ch04.check_paged_decode, stub, match="not implemented yet")
    fails(ch04.check_paged_decode, decode_ignores_lens, match="mask out keys at positions >= context_lens")
    fails(ch04.check_paged_decode, decode_gqa_modulo, match="uses KV head h // ")
    fails(ch04.check_paged_decode, decode_lens_minus_one, match="context_lens\\[b\\] keys")
    fails(ch04.check_paged_decode, decode_returns_fp32, match="dtype")
    passes(ch04.check_paged_decode, decode_fp32_loop, tag="E4.2", capsys=capsys)
    passes(ch04.check_paged_decode, decode_bf16_probs, tag="E4.2", capsys=capsys)
    msg = fails(ch04.check_paged_decode, decode_bf16_compute, match="compute in fp32")
    assert "large scores" in msg and "bfloat16" in msg
    assert "off by up to 0.0625" in msg and "~6.5%" in msg


def test_e4_2_fp32_hint_states_the_bf16_rounding_bound():
    """A score in [16, 32) rounded to bf16 is off by at most half the 0.125 spacing; e^0.0625 - 1 = 6.45%."""
    import math
    s = torch.linspace(16, 31.99, 100_001, dtype=torch.float64)
    err = (s.to(torch.bfloat16).double() - s).abs().max().item()
    assert err <= 0.0625 and err > 0.062
    assert abs(100 * (math.exp(0.0625) - 1) - 6.5) < 0.1
    assert "0.0625" in ch04.FP32_HINT and "6.5%" in ch04.FP32_HINT
    fails(ch04.check_paged_decode, decode_bf16_manual_softmax, match="compute in fp32")


@pytest.mark.parametrize("seed", range(200))
def test_e4_2_bf16_compute_always_caught(seed, capsys):
    """The large-score bf16 case separates fp32 from bf16 arithmetic on every draw: the reference always
    passes and computing in bf16 always fails. (Tuned on 1000 draws each, with decode_fp32_loop and
    decode_bf16_probs passing and decode_bf16_manual_softmax failing every time too.) Checks seed from OS
    entropy, so these are 200 independent draws."""
    passes(ch04.check_paged_decode, torch_backend.paged_decode, tag="E4.2", capsys=capsys)
    fails(ch04.check_paged_decode, decode_bf16_compute, match="compute in fp32")


def store_forgets_v(key, value, k_cache, v_cache, slot_mapping):
    keep = slot_mapping >= 0
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping[keep].long()] = key[keep]


def test_e4_3(capsys):
    passes(ch04.check_store_kvcache, store_kvcache_torch, tag="E4.3", capsys=capsys)
    fails(ch04.check_store_kvcache, stub, match="not implemented yet")
    fails(ch04.check_store_kvcache, store_writes_minus_one, match="slot -1 means")
    fails(ch04.check_store_kvcache, store_swapped, match="swap")
    fails(ch04.check_store_kvcache, store_not_in_place, match="k_cache is unchanged")
    msg = fails(ch04.check_store_kvcache, store_forgets_v, match="v_cache is unchanged")
    assert "v_cache must receive `value` at the same slots as k_cache receives `key`" in msg


def store_clamped_write_back(key, value, k_cache, v_cache, slot_mapping):
    """No boolean filter: padding rows go to slot 0 and write slot 0's old contents back (a write that races
    with the real row writing slot 0)."""
    idx = slot_mapping.long().clamp(min=0)
    valid = (slot_mapping >= 0)[:, None, None]
    for cache, src in ((k_cache, key), (v_cache, value)):
        flat = cache.view(-1, *cache.shape[2:])
        flat[idx] = torch.where(valid, src, flat[idx])


def store_skips_slot_0(key, value, k_cache, v_cache, slot_mapping):
    keep = slot_mapping > 0
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping[keep].long()] = key[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping[keep].long()] = value[keep]


def store_values_as_contiguous(key, value, k_cache, v_cache, slot_mapping):
    """Reads value's memory as if it were a contiguous [N, Hkv, D] tensor (as_strided over its storage)."""
    keep = slot_mapping >= 0
    n, h, d = value.shape
    flat_v = torch.as_strided(value, (n, h, d), (h * d, d, 1))
    k_cache.view(-1, h, d)[slot_mapping[keep].long()] = key[keep]
    v_cache.view(-1, h, d)[slot_mapping[keep].long()] = flat_v[keep]


@pytest.mark.parametrize("fn,says", [
    (store_clamped_write_back, "wrote slot 0's old contents back"),
    (store_skips_slot_0, "slot 0 is a real slot"),
    (store_writes_minus_one, "slot -1 means"),
    (store_values_as_contiguous, "holds the wrong values"),
])
def test_e4_3_edge_slots_and_layouts_are_drawn_every_time(fn, says):
    for _ in range(5):
        fails(ch04.check_store_kvcache, fn, match=says)


def test_ch04_paged_figure_arrows_end_on_their_blocks():
    """Each arrow of figures/ch04_paged_blocks.png starts at its logical block and ends on the top edge of
    the physical block its block table names, inside that block's width and on no other block."""
    from nanovllm_course import figures_ch04
    layout = figures_ch04.paged_layout()
    tables = figures_ch04.EXAMPLE["block_tables"]
    assert sorted((s, i, b) for s, i, b, _, _ in layout["arrows"]) == sorted(
        (s, i, b) for s, t in enumerate(tables) for i, b in enumerate(t))
    for s, i, b, (x0, y0), (x1, y1) in layout["arrows"]:
        lx, ly, lw, _ = layout["logical"][(s, i)]
        assert lx <= x0 <= lx + lw and y0 < ly, (s, i)
        px, py, pw, ph = layout["physical"][b]
        assert px + 0.25 * pw <= x1 <= px + 0.75 * pw and y1 == pytest.approx(py + ph), (s, i, b)
        for other, (ox, oy, ow, oh) in layout["physical"].items():
            if other != b:
                assert not (ox - 0.05 <= x1 <= ox + ow + 0.05), (s, i, b, other)
    # the straight arrows run between the rows, above every physical block and below every logical one
    top = max(py + ph for _, py, _, ph in layout["physical"].values())
    bottom = min(ly for _, ly, _, _ in layout["logical"].values())
    assert all(top <= y1 and y0 < bottom for *_, (_, y0), (_, y1) in layout["arrows"])


def test_ch04_paged_figure_draws_the_layout(tmp_path, monkeypatch):
    """The drawing uses paged_layout's arrows: every FancyArrowPatch goes from a layout start to its end."""
    from matplotlib.patches import FancyArrowPatch
    from nanovllm_course import figures_ch04
    drawn, real_save = [], figures_ch04.save

    def spy(fig, path):
        drawn.extend(tuple(p._posA_posB) for p in fig.axes[0].patches if isinstance(p, FancyArrowPatch))
        return real_save(fig, path)
    monkeypatch.setattr(figures_ch04, "save", spy)
    figures_ch04.paged_blocks(tmp_path / "x.png")
    expected = [(start, end) for *_, start, end in figures_ch04.paged_layout()["arrows"]]
    assert sorted(drawn) == sorted(expected)


# == chapter 05 =============================================================================================

def hash_no_prefix(token_ids, prefix_hash=-1):
    return compute_block_hash(token_ids, -1)


def hash_int32(token_ids, prefix_hash=-1):
    import xxhash
    from array import array
    h = xxhash.xxh64()
    if prefix_hash != -1:
        h.update(prefix_hash.to_bytes(8, "little"))
    h.update(array("i", token_ids).tobytes())
    return h.intdigest()


def hash_zero_is_none(token_ids, prefix_hash=-1):
    return compute_block_hash(token_ids, prefix_hash if prefix_hash else -1)


def hash_hex(token_ids, prefix_hash=-1):
    return hex(compute_block_hash(token_ids, prefix_hash))


class NoDecrement(BlockManager):
    """Ref count not decremented on deallocate: shared blocks are freed while still held."""
    def deallocate(self, seq):
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            if block.ref_count == 1:
                block.ref_count = 0
                self.used_block_ids.remove(block_id)
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_cached_tokens = 0
        seq.num_hashed_blocks = 0


class FreeForgetsHash(BlockManager):
    """A freed block loses its hash (and its hash-map entry)."""
    def deallocate(self, seq):
        for block_id in seq.block_table:
            block = self.blocks[block_id]
            if block.ref_count == 1 and block.hash != -1:
                self.hash_to_block_id.pop(block.hash, None)
                block.hash, block.token_ids = -1, []
        super().deallocate(seq)


class HitsUnwritten(BlockManager):
    """Registers hashes at allocation time: a second request can hit blocks whose K/V is not written yet."""
    def allocate(self, seq):
        super().allocate(seq)
        saved = seq.num_cached_tokens
        seq.num_cached_tokens = len(seq)
        self.hash_blocks(seq)
        seq.num_cached_tokens = saved


class UnchainedHashBlocks(BlockManager):
    """hash_blocks ignores the previous block's hash."""
    def hash_blocks(self, seq):
        if not self.enable_prefix_caching:
            return
        for i in range(seq.num_hashed_blocks, seq.num_cached_tokens // self.block_size):
            block = self.blocks[seq.block_table[i]]
            block.hash = compute_block_hash(seq.block(i), -1)
            block.token_ids = list(seq.block(i))
            self.hash_to_block_id[block.hash] = block.block_id
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, seq.num_cached_tokens // self.block_size)


class LifoFree(BlockManager):
    """Free pool used as a stack: the most recently freed block is handed out first."""
    def _take_free_block(self):
        block_id, _ = self.free_block_ids.popitem(last=True)
        block = self.blocks[block_id]
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.reset()
        self.used_block_ids.add(block_id)
        return block_id


class NoRevivedCount(BlockManager):
    """can_allocate forgets that hits sitting in the free pool use up free blocks too."""
    def can_allocate(self, seq):
        return self.num_free_blocks >= seq.num_blocks - len(self._match_prefix(seq))


class NoFullHitPop(BlockManager):
    """A fully cached prompt keeps every hit: no token left to compute."""
    def _match_prefix(self, seq):
        hits = super()._match_prefix(seq)
        n = len(seq) // self.block_size
        if self.enable_prefix_caching and len(hits) == n - 1 and n > 0 and len(seq) % self.block_size == 0:
            prev = self.blocks[hits[-1]].hash if hits else -1
            h = compute_block_hash(seq.block(n - 1), prev)
            if h in self.hash_to_block_id:
                hits.append(self.hash_to_block_id[h])
        return hits


class StaleHashOnReuse(BlockManager):
    """Re-using a freed block keeps its old hash-map entry and contents."""
    def _take_free_block(self):
        block_id, _ = self.free_block_ids.popitem(last=False)
        self.blocks[block_id].ref_count = 1
        self.used_block_ids.add(block_id)
        return block_id


class CanAppendAlways(BlockManager):
    def can_append(self, seq):
        return True

    def may_append(self, seq):
        if len(seq.block_table) < seq.num_blocks and self.free_block_ids:
            seq.block_table.append(self._take_free_block())


class AppendEveryStep(BlockManager):
    """may_append adds a block when the last block becomes full, one token too early."""
    def can_append(self, seq):
        return len(seq) % self.block_size != 0 or self.num_free_blocks >= 1

    def may_append(self, seq):
        if len(seq) % self.block_size == 0:
            seq.block_table.append(self._take_free_block())


class FreeFirstToLast(BlockManager):
    """deallocate frees the table from its first block to its last: the shared head is reused first."""
    def deallocate(self, seq):
        for block_id in seq.block_table:
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_cached_tokens = 0
        seq.num_hashed_blocks = 0


class KeepsCachedTokens(BlockManager):
    """deallocate forgets to reset num_cached_tokens."""
    def deallocate(self, seq):
        n = seq.num_cached_tokens
        super().deallocate(seq)
        seq.num_cached_tokens = n


class AllocateNeverRaises(BlockManager):
    """allocate trusts the caller: no RuntimeError without room or for a sequence that has blocks."""
    def allocate(self, seq):
        hits = self._match_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
                self.used_block_ids.add(block_id)
            block.ref_count += 1
        fresh = [self._take_free_block() for _ in range(seq.num_blocks - len(hits)) if self.free_block_ids]
        seq.block_table = hits + fresh
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)


class AllocateTwice(BlockManager):
    """allocate raises when there is no room, but re-allocates a sequence that already has blocks."""
    def allocate(self, seq):
        table, seq.block_table = seq.block_table, []
        try:
            super().allocate(seq)
        except RuntimeError:
            seq.block_table = table
            raise


class NoTokenCompare(BlockManager):
    """_match_prefix trusts the hash: a hit is never checked against the block's token ids."""
    def _match_prefix(self, seq):
        if not self.enable_prefix_caching:
            return []
        hits, h = [], -1
        for i in range(len(seq) // self.block_size):
            h = compute_block_hash(seq.block(i), h)
            if h not in self.hash_to_block_id:
                break
            hits.append(self.hash_to_block_id[h])
        if hits and len(hits) * self.block_size == len(seq):
            hits.pop()
        return hits


class HashBlocksNoAdvance(BlockManager):
    """hash_blocks registers the new blocks but leaves seq.num_hashed_blocks behind."""
    def hash_blocks(self, seq):
        n = seq.num_hashed_blocks
        super().hash_blocks(seq)
        seq.num_hashed_blocks = n


class KeepsHashedBlocks(BlockManager):
    """deallocate forgets to reset num_hashed_blocks (block_table and num_cached_tokens are reset)."""
    def deallocate(self, seq):
        n = seq.num_hashed_blocks
        super().deallocate(seq)
        seq.num_hashed_blocks = n


class StubManager:
    def __init__(self, num_blocks, block_size, enable_prefix_caching=True):
        raise NotImplementedError("Exercise 5.2: fill in this code")


def test_e5_1(capsys):
    passes(ch05.check_compute_block_hash, compute_block_hash, tag="E5.1", capsys=capsys)
    fails(ch05.check_compute_block_hash, stub, match="not implemented yet")
    fails(ch05.check_compute_block_hash, hash_no_prefix, match="must chain")
    fails(ch05.check_compute_block_hash, hash_int32, match="8 little-endian bytes")
    fails(ch05.check_compute_block_hash, hash_zero_is_none, match="0 is a valid hash")
    fails(ch05.check_compute_block_hash, hash_hex, match="Python int")


def test_e5_2(capsys):
    passes(ch05.check_block_manager_basics, BlockManager, tag="E5.2", capsys=capsys)
    fails(ch05.check_block_manager_basics, StubManager, match="not implemented yet")
    fails(ch05.check_block_manager_basics, LifoFree, match="scenario 'allocate and free'")
    fails(ch05.check_block_manager_basics, CanAppendAlways, match="can_append")
    fails(ch05.check_block_manager_basics, AppendEveryStep, match="decode appends")


def test_e5_2_hints_come_from_what_differs():
    """Wrong deallocation order and a stale num_cached_tokens are named as such, not as can_allocate /
    can_append faults (the hint follows the field that differs and the operation that just ran)."""
    for check in (ch05.check_block_manager_basics, ch05.check_prefix_caching):
        hint = fails(check, FreeFirstToLast, match="free pool in the order").split("hint:")[1]
        assert "from its last block to its first" in hint
        assert "can_allocate" not in hint and "can_append" not in hint
        msg = fails(check, KeepsCachedTokens, match="num_cached_tokens")
        hint = msg.split("hint:")[1]
        assert "deallocate resets the sequence" in hint and "can_append" not in hint


def test_e5_2_checks_ref_counts_without_caching():
    fails(ch05.check_block_manager_basics, NoDecrement, match="scenario 'shared blocks'")


def test_e5_2_allocate_must_raise():
    msg = fails(ch05.check_block_manager_basics, AllocateNeverRaises, match="allocate\\(B\\) returned without raising")
    assert "allocate raises RuntimeError" in msg
    fails(ch05.check_block_manager_basics, AllocateTwice, match="allocate\\(B\\) returned without raising, but B already has")


def test_e5_2_stub_methods():
    class Partial(BlockManager):
        def can_append(self, seq):
            raise NotImplementedError("Exercise 5.2: fill in this code")
    fails(ch05.check_block_manager_basics, Partial, match="not implemented yet")


def test_e5_3(capsys):
    passes(ch05.check_prefix_caching, BlockManager, tag="E5.3", capsys=capsys)
    fails(ch05.check_prefix_caching, StubManager, match="not implemented yet")
    fails(ch05.check_prefix_caching, NoDecrement, match="decrements the ref count")
    fails(ch05.check_prefix_caching, FreeForgetsHash, match="freed block keeps its hash")
    fails(ch05.check_prefix_caching, HitsUnwritten, match="register nothing before hash_blocks")
    fails(ch05.check_prefix_caching, UnchainedHashBlocks, match="chain the hashes")
    fails(ch05.check_prefix_caching, NoRevivedCount, match="free pool")
    fails(ch05.check_prefix_caching, NoFullHitPop, match="whole prompt cached")
    fails(ch05.check_prefix_caching, StaleHashOnReuse, match="reset an old one")
    fails(ch05.check_prefix_caching, NoTokenCompare, match="compare the block's token_ids")
    fails(ch05.check_prefix_caching, HashBlocksNoAdvance, match="advances seq.num_hashed_blocks")


def test_e5_3_deallocate_must_reset_num_hashed_blocks():
    for _ in range(3):
        msg = fails(ch05.check_prefix_caching, KeepsHashedBlocks, match="num_hashed_blocks")
        assert "num_hashed_blocks = 0" in msg.split("hint:")[1], msg


@pytest.mark.parametrize("seed", range(5))
def test_e5_random_stream_agrees_with_itself(seed):
    import random
    rng = random.Random(seed)
    for caching in (False, True):
        ch05._random_stream("E5.x", BlockManager, rng, caching)


def test_checks_draw_fresh_inputs(monkeypatch):
    """Two calls of a check see different inputs (the generator is seeded from the OS)."""
    seen = []

    def spy(block_table, start, end, block_size):
        seen.append((tuple(block_table), start, end, block_size))
        return slots_ref(block_table, start, end, block_size)
    ch04.check_slot_mapping(spy)
    first = list(seen)
    seen.clear()
    ch04.check_slot_mapping(spy)
    assert first != seen


def _chapter05_classes(e52_from: str, e53_from: str) -> dict:
    """Run chapter 05's set-up cell and its two BlockManager cells, each from the solution or the released
    chapter (the stubs), in one namespace."""
    import json
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    name = "05_block_manager_prefix_caching.ipynb"

    def cells(folder):
        nb = json.loads((root / folder / name).read_text())
        return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    sol, chap = cells("solutions"), cells("chapters")
    pick = {"solutions": sol, "chapters": chap}
    e52 = next(i for i, c in enumerate(sol) if "class BlockManager" in c)
    e53 = next(i for i, c in enumerate(sol) if "class CachingBlockManager" in c)
    ns: dict = {}
    exec(sol[0], ns)                                        # imports
    exec(pick[e52_from][e52], ns)
    exec(pick[e53_from][e53], ns)
    return ns


@pytest.mark.parametrize("e52_from", ["solutions", "chapters"])
def test_e5_3_stub_names_exercise_5_3(e52_from):
    """An unfilled E5.3 is reported as Exercise 5.3, whether or not E5.2 is done; E5.2's stub as 5.2."""
    ns = _chapter05_classes(e52_from, "chapters")
    msg = fails(ch05.check_prefix_caching, ns["CachingBlockManager"], match="not implemented yet")
    assert "Exercise 5.3" in msg and "Exercise 5.2" not in msg
    if e52_from == "chapters":
        msg = fails(ch05.check_block_manager_basics, ns["BlockManager"], match="not implemented yet")
        assert "Exercise 5.2" in msg


def test_e5_solution_classes_pass_their_own_checks(capsys):
    """E5.2's class passes E5.2 (and not E5.3: it does not cache); the E5.3 subclass passes both."""
    ns = _chapter05_classes("solutions", "solutions")
    passes(ch05.check_block_manager_basics, ns["BlockManager"], tag="E5.2", capsys=capsys)
    passes(ch05.check_prefix_caching, ns["CachingBlockManager"], tag="E5.3", capsys=capsys)
    passes(ch05.check_block_manager_basics, ns["CachingBlockManager"], tag="E5.2", capsys=capsys)
    fails(ch05.check_prefix_caching, ns["BlockManager"], match="E5.3")


@pytest.mark.parametrize("name, exercises", [("03_qwen3_model.ipynb", ("E3.2",)),
                                             ("05_block_manager_prefix_caching.ipynb", ("E5.2", "E5.3"))])
def test_spec_is_not_a_transcription_of_the_solution(name, exercises):
    """The markdown states what to compute: no statement of these exercises' solutions appears in it verbatim."""
    import json
    import re
    from pathlib import Path
    nb = json.loads((Path(__file__).resolve().parents[1] / "solutions" / name).read_text())
    markdown = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    markdown = re.sub(r"\s+", " ", markdown)
    copied = []
    for cell in nb["cells"]:
        inside = False
        for line in "".join(cell["source"]).splitlines():
            if "### BEGIN SOLUTION" in line:
                inside = any(f"SOLUTION {e}" in line for e in exercises)
            elif "### END SOLUTION" in line:
                inside = False
            elif inside and len(line.strip()) >= 20 and re.sub(r"\s+", " ", line.strip()) in markdown:
                copied.append(line.strip())
    assert not copied, copied


# == every hint of chapters 03-05 has a mutant that reaches it =============================================

def gqa_scaled_in_place(q, k, v, scale):
    q.mul_(scale)                                              # pre-scale q "to save a multiply"
    return ch03.reference_gqa_attention(q, k, v, 1.0)


def gqa_uniform(q, k, v, scale):
    """No mask, no scale, no query: the mean of the values (nothing the usual mistakes explain)."""
    group = q.shape[1] // k.shape[1]
    return v.float().repeat_interleave(group, 1).mean(0, keepdim=True).expand(q.shape).to(q.dtype)


def attn_no_o_proj(attn, positions, x):
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = attn.q_norm(q.reshape(-1, attn.num_heads, attn.head_dim))
    k = attn.k_norm(k.reshape(-1, attn.num_kv_heads, attn.head_dim))
    q, k = attn.rotary_emb(positions, q, k)
    return attn.attn(q.flatten(1), k.flatten(1), v)           # o_proj forgotten (same width in some configs)


def mlp_no_silu(mlp, x):
    gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
    return mlp.down_proj(gate * up)


def qkv_skips_v(param, w, shard_id, q_size, kv_size):
    if shard_id != "v":
        qkv_ref(param, w, shard_id, q_size, kv_size)


def qkv_scaled(param, w, shard_id, q_size, kv_size):
    qkv_ref(param, w * 0.5, shard_id, q_size, kv_size)


def qkv_frees_checkpoint(param, w, shard_id, q_size, kv_size):
    qkv_ref(param, w, shard_id, q_size, kv_size)
    w.zero_()


def test_ch03_hints_are_reached():
    for _ in range(3):
        fails(ch03.check_gqa_attention, gqa_scaled_in_place, match="gqa_attention changed its input q")
        msg = fails(ch03.check_gqa_attention, gqa_uniform, match="output differs from the reference")
        assert "out[i, h] = softmax(scale" in msg
        msg = fails(ch03.check_decoder_blocks, attn_no_o_proj, mlp_ref, match="attention_forward")
        assert "-> o_proj" in msg
        msg = fails(ch03.check_decoder_blocks, attn_ref, mlp_no_silu, match="mlp_forward differs")
        assert "down_proj(silu(gate) * up)" in msg
        fails(ch03.check_packed_loaders, qkv_skips_v, gate_up_ref, match="where shard 'v' belongs, were never written")
        fails(ch03.check_packed_loaders, qkv_scaled, gate_up_ref, match="hold the wrong values")
        fails(ch03.check_packed_loaders, qkv_frees_checkpoint, gate_up_ref, match="changed the checkpoint tensor")


def test_e3_4_hints_are_reached():
    base = make_prefill_logits()

    def prompts_by_length(model, prompts):          # packs the prompts sorted by length: ids in another order
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out = base(model, [prompts[i] for i in order])
        return out[torch.tensor(order).argsort()]

    def positions_from_one(model, prompts):
        ids = torch.tensor([t for p in prompts for t in p])
        pos = torch.tensor([i + 1 for p in prompts for i in range(len(p))])
        lens = [len(p) for p in prompts]
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        with attention_metadata(AttentionMetadata(is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                  max_seqlen_q=max(lens), max_seqlen_k=max(lens))):
            hidden = model(ids, pos)
        return model.compute_logits(hidden[torch.tensor(lens).cumsum(0) - 1])

    build = make_build_model()
    fails(ch03.check_prefill_logits, prompts_by_length, build, match="the input_ids handed to the model")
    msg = fails(ch03.check_prefill_logits, positions_from_one, build, match="the positions handed to the model")
    assert "positions = 0, 1, ..., len(prompt) - 1" in msg
    fails(ch03.check_prefill_logits, base, lambda d: build(d).state_dict(), match="expected the model")
    fails(ch03.check_prefill_logits, base, lambda d: build(d).to(torch.bfloat16), match="expected torch.float32")

    def hf_model(model_dir):
        return ch03.hf_model(model_dir)
    fails(ch03.check_prefill_logits, base, hf_model, match="has no parameter")


def slots_2d(block_table, start, end, block_size):
    return torch.tensor(slots_ref(block_table, start, end, block_size))[None]


def slots_floats(block_table, start, end, block_size):
    return [float(s) for s in slots_ref(block_table, start, end, block_size)]


def slots_numpy(block_table, start, end, block_size):
    import numpy as np
    return np.array(slots_ref(block_table, start, end, block_size))


def slots_stride_plus_one(block_table, start, end, block_size):
    return [block_table[p // block_size] * (block_size + 1) + p % block_size for p in range(start, end)]


def decode_scales_q_in_place(q, k_cache, v_cache, block_tables, context_lens, scale):
    q.mul_(scale)
    return torch_backend.paged_decode(q, k_cache, v_cache, block_tables, context_lens, 1.0)


def store_drops_last_token(key, value, k_cache, v_cache, slot_mapping):
    store_kvcache_torch(key[:-1], value[:-1], k_cache, v_cache, slot_mapping[:-1])


def test_ch04_hints_are_reached():
    for _ in range(3):
        fails(ch04.check_slot_mapping, slots_2d, match="should be a 1-D integer tensor")
        fails(ch04.check_slot_mapping, slots_floats, match="should hold ints")
        fails(ch04.check_slot_mapping, slots_numpy, match="got ndarray")
        msg = fails(ch04.check_slot_mapping, slots_stride_plus_one, match="went to slot")
        assert "slot(p) = block_table[p // block_size] * block_size + p % block_size" in msg
        fails(ch04.check_paged_decode, decode_scales_q_in_place, match="paged_decode modified its input q")
        msg = fails(ch04.check_store_kvcache, store_drops_last_token, match="holds the wrong values|was not written")
        assert "every row whose slot is >= 0 is written" in msg or "slot 0 is a real slot" in msg


def hash_prefix_default_zero(token_ids, prefix_hash=0):
    """Right for an explicit -1, but the default prefix is 0, not -1."""
    return compute_block_hash(token_ids, prefix_hash)


class CanAllocateRaises(BlockManager):
    """can_allocate indexes the pool with the table it does not have yet."""
    def can_allocate(self, seq):
        return self.blocks[seq.block_table[0]].ref_count >= 0 or super().can_allocate(seq)


class AllocateRaisesValueError(BlockManager):
    def allocate(self, seq):
        if seq.block_table or not self.can_allocate(seq):
            raise ValueError("no room")
        super().allocate(seq)


class AllocateRefusalNotDone(BlockManager):
    """The refusal branch of allocate is still a stub."""
    def allocate(self, seq):
        if seq.block_table or not self.can_allocate(seq):
            raise NotImplementedError("Exercise 5.2: refuse")
        super().allocate(seq)


class HitNoRef(BlockManager):
    """A prefix hit is put in the table without taking a reference on it."""
    def allocate(self, seq):
        super().allocate(seq)
        for block_id in seq.block_table[:seq.num_cached_tokens // self.block_size]:
            self.blocks[block_id].ref_count -= 1


def _called_from_the_invariant_checker():
    import sys
    return sys._getframe(2).f_code.co_name == "check_block_manager"


class NoBlocksAttribute(BlockManager):
    """Keeps its blocks under another name (`pool`): the invariant checker finds no `blocks`."""
    def __init__(self, *args):
        super().__init__(*args)
        self.pool = self.__dict__.pop("blocks")

    @property
    def blocks(self):
        if _called_from_the_invariant_checker():
            raise AttributeError("'NoBlocksAttribute' object has no attribute 'blocks'")
        return self.pool

    @blocks.setter
    def blocks(self, value):
        self.__dict__["blocks"] = value


class HitsNotHashedCount(BlockManager):
    """allocate leaves num_hashed_blocks at 0 after prefix hits."""
    def allocate(self, seq):
        super().allocate(seq)
        seq.num_hashed_blocks = 0


class KeepsTable(BlockManager):
    """deallocate frees the blocks but leaves the sequence's table in place."""
    def deallocate(self, seq):
        table = list(seq.block_table)
        super().deallocate(seq)
        seq.block_table = table


class HitsCountBlocks(BlockManager):
    """num_cached_tokens set to the number of hit blocks, not hit tokens."""
    def allocate(self, seq):
        super().allocate(seq)
        seq.num_cached_tokens //= self.block_size


class RevivesBySorting(BlockManager):
    """Takes a revived hit out of the free pool by rebuilding the pool, sorted: the tables are right, the order of
    the blocks left in the pool is not."""
    def allocate(self, seq):
        super().allocate(seq)
        from collections import OrderedDict
        self.free_block_ids = OrderedDict((b, None) for b in sorted(self.free_block_ids))


class KeepsCachedWhenPreemptedMidPrompt(BlockManager):
    """deallocate of a sequence preempted in the middle of its prompt (chunked prefill) keeps num_cached_tokens:
    only the random streams (preemption under chunked prefill) get there."""
    def deallocate(self, seq):
        partial = 0 < seq.num_cached_tokens < len(seq) and seq.num_cached_tokens % self.block_size
        n = seq.num_cached_tokens
        super().deallocate(seq)
        if partial:
            seq.num_cached_tokens = n


def test_e5_random_streams_catch_what_the_scenarios_do_not():
    msg = fails(ch05.check_block_manager_basics, KeepsCachedWhenPreemptedMidPrompt, match="random request stream")
    assert "num_cached_tokens" in msg and "deallocate resets the sequence" in msg


class HashBlocksNoTokenIds(BlockManager):
    """hash_blocks registers the hash but leaves the block's token_ids empty: no hit can be verified."""
    def hash_blocks(self, seq):
        super().hash_blocks(seq)
        for b in seq.block_table:
            self.blocks[b].token_ids = []


def test_e5_3_hashed_blocks_keep_their_token_ids():
    for _ in range(3):
        msg = fails(ch05.check_prefix_caching, HashBlocksNoTokenIds, match="holds no token ids")
        assert "block.token_ids = seq.block(i)" in msg


def test_ch05_hints_are_reached():
    for _ in range(3):
        fails(ch05.check_compute_block_hash, hash_prefix_default_zero, match="without a prefix differs")
        fails(ch05.check_block_manager_basics, CanAllocateRaises, match="can_allocate\\(A\\) raised IndexError")
        fails(ch05.check_block_manager_basics, AllocateRaisesValueError, match="raised ValueError: no room, expected "
                                                                               "RuntimeError")
        fails(ch05.check_block_manager_basics, AllocateRefusalNotDone, match=r"not implemented yet .* \[in allocate")
        msg = fails(ch05.check_prefix_caching, HitNoRef, match="invariant broken")
        assert "allocate adds one reference to every block" in msg
        fails(ch05.check_block_manager_basics, NoBlocksAttribute, match="check_block_manager could not read the manager")
        msg = fails(ch05.check_prefix_caching, HitsNotHashedCount, match="num_hashed_blocks")
        assert "allocate sets num_hashed_blocks to the number of prefix-hit blocks" in msg
        msg = fails(ch05.check_block_manager_basics, KeepsTable, match="block_table")
        assert "deallocate empties the sequence's table" in msg
        msg = fails(ch05.check_prefix_caching, HitsCountBlocks, match="num_cached_tokens")
        assert "allocate sets num_cached_tokens = number of prefix-hit blocks * block_size" in msg
        msg = fails(ch05.check_prefix_caching, RevivesBySorting, match="free pool in the order")
        assert "take from its front" in msg


def test_no_released_stub_spells_out_its_own_answer():
    """A stub keeps its docstring and comments: none may hold the answer of its region. E4.1's docstring was the
    whole solution ("block_table[p // block_size] * block_size + p % block_size"). For every region whose answer
    is one expression, no part of it of 25 characters or more (spaces ignored) may appear in the released cell."""
    import ast
    import glob
    from pathlib import Path

    import nbformat

    from nanovllm_course import release
    found = []
    for path in sorted(glob.glob(str(Path(__file__).resolve().parents[1] / "solutions" / "*.ipynb"))):
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code" or not release.is_exercise_cell(cell):
                continue
            lines = cell.source.split("\n")
            stub = "".join(release.stub_source(cell.source).split())
            for region in release.find_regions(cell.source):
                body = [l.strip() for l in lines[region.begin + 1:region.end] if l.strip() and not l.strip().startswith("#")]
                if len(body) != 1:
                    continue
                code = body[0].removeprefix("return ")
                try:
                    tree = ast.parse(code, mode="eval")
                except SyntaxError:
                    continue
                parts = {ast.get_source_segment(code, node) for node in ast.walk(tree) if hasattr(node, "col_offset")}
                for part in sorted(p for p in parts if p):
                    if len("".join(part.split())) >= 25 and "".join(part.split()) in stub:
                        found.append((Path(path).name, i, region.exercise, part))
    assert not found, found
