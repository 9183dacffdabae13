"""Checks for chapter 03: the Qwen3 model and its weight loader.

- `check_gqa_attention(fn)` (E3.1): fn(q, k, v, scale), q [T, H, D], k/v [T, Hkv, D], causal, compared with
  `nanovllm_ref.attn.torch_backend.varlen_prefill` on one sequence (fp32: rtol 1e-4, atol 1e-5;
  bf16: rtol 2e-2, atol 2e-2); in two cases q, k, v are views of one fused QKV output; inputs unchanged.
- `check_decoder_blocks(attention_forward, mlp_forward)` (E3.2): the attention block (fused QKV split ->
  per-head q/k RMSNorm -> RoPE -> attention -> o_proj) and the MLP (gate_up -> SiLU(gate) * up -> down),
  compared with `nanovllm_ref.models.qwen3.DecoderAttention` / `DecoderMLP` with random weights
  (fp32: rtol 1e-4, atol 1e-5).
- `check_packed_loaders(qkv_weight_loader, gate_up_weight_loader)` (E3.3): the rows each checkpoint tensor
  lands in must equal what `QKVParallelLinear.weight_loader` / `MergedColumnParallelLinear.weight_loader`
  produce (exactly), in the parameter's own memory and dtype (some checkpoints are bf16 for the fp32
  parameter), with the checkpoint tensor unchanged.
- `check_prefill_logits(prefill_logits, build_model)` (E3.4): build_model(model_dir) must give our
  Qwen3ForCausalLM with the checkpoint's weights (each Attention layer uses the torch back-end by default);
  prefill_logits(model, prompts) the last-token logits of the packed prompts, which must match HF
  transformers' Qwen3ForCausalLM on the tiny checkpoint (fp32: rtol 1e-4, atol 1e-4). The check also
  records what prefill_logits hands the model (one forward; input_ids and positions, compared exactly):
  positions counted across the whole batch give the right logits here (RoPE scores depend on distances
  only, and each prompt attends to itself alone), but would put keys at wrong positions in a KV cache.

The `reference_*` functions are the reference answers, for later sections of the notebook and for tests.

Every check draws fresh random inputs on each call and prints `E3.n ok` and nothing else on success.
"""
import contextlib
import functools
import random
import warnings

import torch
import torch.nn.functional as F

from nanovllm_ref.attn import get_backend, torch_backend
from nanovllm_course.common import call_student, check_close, fail, fresh_generator, ok, tiny_model_dir
from nanovllm_ref.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from nanovllm_ref.layers.rotary_embedding import apply_rotary
from nanovllm_ref.utils.context import AttentionMetadata, attention_metadata

TOL32 = dict(rtol=1e-4, atol=1e-5)
TOL16 = dict(rtol=2e-2, atol=2e-2)


@contextlib.contextmanager
def quiet():
    """No warnings and no HF progress bars (they would land in the notebook's output)."""
    from transformers.utils import logging as hf_logging
    bar, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()


def _rng(gen: torch.Generator) -> random.Random:
    return random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))


def _prefill_context(lengths: list[int]):
    """`with _prefill_context(lengths):` the attention metadata of one prefill step over packed sequences of
    these lengths (no KV cache)."""
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    return attention_metadata(AttentionMetadata(is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                max_seqlen_q=max(lengths), max_seqlen_k=max(lengths)))


def _positions(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([p for n in lengths for p in range(n)], dtype=torch.int64)


# -- E3.1 GQA causal attention ----------------------------------------------------------------------------


def reference_gqa_attention(q, k, v, scale):
    """Causal attention of one sequence: q [T, H, D], k/v [T, Hkv, D] -> [T, H, D] in q's dtype."""
    cu = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    return torch_backend.varlen_prefill(q, k, v, cu, cu, q.shape[0], q.shape[0], scale)


def _attention_math(q, k, v, scale, kv_head, mask="causal"):
    """Explicit attention with a chosen query-head -> KV-head map and mask ("causal", "none" or "upper"),
    for the mistake variants."""
    T = q.shape[0]
    kk, vv = k.float()[:, kv_head], v.float()[:, kv_head]                       # [T, H, D]
    scores = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale
    if mask != "none":
        ones = torch.ones(T, T, dtype=torch.bool)
        keep = ones.tril() if mask == "causal" else ones.triu()
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), vv).to(q.dtype)


def _gqa_hints(got, q, k, v, scale, tol):
    H, Hkv = q.shape[1], k.shape[1]
    group = H // Hkv
    right = torch.arange(H) // group
    variants = [
        (_attention_math(q, k, v, scale, right, mask="none"),
         "apply the causal mask: query i may only see keys 0..i (set the scores of keys j > i to -inf "
         "before the softmax)"),
        (_attention_math(q, k, v, scale, right, mask="upper"),
         "the mask is the wrong way round: query i sees keys j <= i (lower triangle), not j >= i"),
        (_attention_math(q, k, v, 1.0, right), "multiply the scores q . k by `scale` before the softmax"),
    ]
    if Hkv != H:
        variants.append((_attention_math(q, k, v, scale, torch.arange(H) % Hkv),
                         f"GQA: with {H} query heads and {Hkv} KV heads, query head h uses KV head h // {group} "
                         f"(repeat_interleave each KV head {group} times), not h % {Hkv} (repeat)"))
    for variant, hint in variants:
        if got.shape == variant.shape and torch.allclose(got.float(), variant.float(), **tol):
            return hint
    return "out[i, h] = softmax(scale * q[i, h] . k[j, h // group] for j <= i) @ v[:, h // group]"


def check_gqa_attention(fn) -> None:
    tag = "E3.1"
    gen = fresh_generator()
    rng = _rng(gen)
    cases = [(1, 4, 2, 8, torch.float32), (7, 4, 4, 16, torch.float32), (16, 8, 1, 8, torch.float32),
             (rng.randint(17, 40), 6, 2, 16, torch.float32), (rng.randint(2, 12), 8, 2, 64, torch.float32),
             (rng.randint(5, 20), 4, 2, 16, torch.bfloat16)]
    for n, (T, H, Hkv, D, dtype) in enumerate(cases):
        if n in (3, 5):        # q, k, v as the engine may pass them: views of one fused [T, (H + 2 Hkv) D] output
            qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=gen).to(dtype)
            q, k, v = (t.view(T, -1, D) for t in qkv.split([H * D, Hkv * D, Hkv * D], dim=-1))
        else:
            q = torch.randn(T, H, D, generator=gen).to(dtype)
            k = torch.randn(T, Hkv, D, generator=gen).to(dtype)
            v = torch.randn(T, Hkv, D, generator=gen).to(dtype)
        scale = D ** -0.5
        expected = reference_gqa_attention(q, k, v, scale)
        args = [q.clone(), k.clone(), v.clone()]
        got = call_student(tag, fn, *args, scale)
        for name, a, b in zip("qkv", args, (q, k, v)):
            if not torch.equal(a, b):
                fail(tag, f"gqa_attention changed its input {name}", "attention only reads q, k and v")
        tol = TOL32 if dtype == torch.float32 else TOL16
        where = (f"T={T} tokens, {H} query heads, {Hkv} KV heads, head_dim {D}, {str(dtype)[6:]}"
                 + ("" if q.is_contiguous() else ", q, k, v views of a fused QKV output"))
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and got.dtype == expected.dtype \
                and not torch.allclose(got.float(), expected.float(), **tol):
            bad = ((got.float() - expected.float()).abs() > tol["atol"] + tol["rtol"] * expected.float().abs())
            i, h = (int(x) for x in bad.nonzero()[0][:2])
            fail(tag, f"output differs from the reference at token {i}, query head {h} [{where}]",
                 _gqa_hints(got, q, k, v, scale, tol))
        check_close(tag, got, expected, **tol, what=f"gqa_attention output [{where}]",
                    hint="return [T, H, D] in q's dtype (compute in fp32, cast back)")
    ok(tag)


# -- E3.2 the attention block and the MLP -----------------------------------------------------------------


def _random_layer(gen: torch.Generator, heads: int, kv_heads: int, head_dim: int, hidden: int, inter: int):
    """A DecoderAttention and a DecoderMLP with random weights, including non-trivial q/k norm weights
    (with all-ones norm weights, norm and RoPE would commute and a wrong order could go unnoticed)."""
    from nanovllm_ref.models.qwen3 import DecoderAttention, DecoderMLP
    from nanovllm_models.tiny import tiny_config
    cfg = tiny_config("qwen3", num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      hidden_size=hidden, intermediate_size=inter)
    attn, mlp = DecoderAttention(cfg, qk_norm=True), DecoderMLP(cfg)
    with torch.no_grad():
        for module in (attn, mlp):
            for name, p in module.named_parameters():
                if "norm" in name:
                    p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    attn.attn.backend = get_backend("torch")
    return attn.eval(), mlp.eval()


def _attention_variant(attn, positions, x, *, rope_first=False, norm=True, swap_kv=False, k_uses_q_norm=False):
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    if swap_kv:
        k, v = v, k
    q = q.reshape(-1, attn.num_heads, attn.head_dim)
    k = k.reshape(-1, attn.num_kv_heads, attn.head_dim)
    cos, sin = attn.rotary_emb.cos_sin_cache[positions].chunk(2, dim=-1)
    k_norm = attn.q_norm if k_uses_q_norm else attn.k_norm
    if rope_first:
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    if norm:
        q, k = attn.q_norm(q), k_norm(k)
    if not rope_first:
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    return attn.o_proj(attn.attn(q.flatten(1), k.flatten(1), v))


def _attention_hint(got, attn, positions, x):
    variants = [
        (dict(rope_first=True), "Qwen3 normalises each head (q_norm, k_norm) *before* RoPE; normalising after "
                                "RoPE scales rotated channels by the wrong weights"),
        (dict(norm=False), "apply attn.q_norm to q and attn.k_norm to k, per head (shape [N, heads, head_dim])"),
        (dict(swap_kv=True), "the fused projection's output is [q | k | v] with widths q_size, kv_size, "
                             "kv_size: split in that order"),
        (dict(k_uses_q_norm=True), "k has its own norm: attn.k_norm, not attn.q_norm"),
    ]
    for kwargs, hint in variants:
        try:
            variant = _attention_variant(attn, positions, x, **kwargs)
        except Exception:
            continue
        if torch.allclose(got, variant, **TOL32):
            return hint
    return ("qkv_proj -> split [q | k | v] -> reshape to heads -> q_norm / k_norm -> rotary_emb(positions, q, k) "
            "-> attn(q.flatten(1), k.flatten(1), v) -> o_proj")


def _mlp_hint(got, mlp, x):
    gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
    variants = [
        (mlp.down_proj(F.silu(up) * gate), "the first half of gate_up_proj's output is the gate (it goes "
                                           "through SiLU), the second half is up"),
        (mlp.down_proj(F.silu(gate * up)), "SiLU applies to the gate only: silu(gate) * up"),
        (mlp.down_proj(F.gelu(gate) * up), "Qwen3's activation is SiLU (x * sigmoid(x)), not GELU"),
    ]
    for variant, hint in variants:
        if got.shape == variant.shape and torch.allclose(got, variant, **TOL32):
            return hint
    return "down_proj(silu(gate) * up) with [gate | up] = gate_up_proj(x)"


def check_decoder_blocks(attention_forward, mlp_forward) -> None:
    tag = "E3.2"
    gen = fresh_generator()
    rng = _rng(gen)
    configs = [(4, 2, 16, 64, 96), (4, 4, 8, 32, 64), (8, 2, 16, 48, 40), (6, 1, 8, 24, 24)]
    shapes = [[1], [rng.randint(2, 9)], [1, rng.randint(3, 17), rng.randint(1, 6)],
              [rng.randint(2, 12), rng.randint(2, 12)]]          # one token alone (RoPE at position 0), packs
    rng.shuffle(shapes)
    for (heads, kv_heads, head_dim, hidden, inter), lengths in zip(configs, shapes):
        attn, mlp = _random_layer(gen, heads, kv_heads, head_dim, hidden, inter)
        positions = _positions(lengths)
        x = torch.randn(len(positions), hidden, generator=gen)
        where = (f"{heads} query heads, {kv_heads} KV heads, head_dim {head_dim}, hidden {hidden}, "
                 f"sequences of {lengths} tokens")
        with torch.no_grad():
            with _prefill_context(lengths):
                expected = attn(positions, x)
                got = call_student(tag, attention_forward, attn, positions.clone(), x.clone())
                if isinstance(got, torch.Tensor) and got.shape == expected.shape and got.dtype == expected.dtype \
                        and not torch.allclose(got, expected, **TOL32):
                    fail(tag, f"attention_forward differs from the reference [{where}]",
                         _attention_hint(got, attn, positions, x))
            check_close(tag, got, expected, **TOL32, what=f"attention_forward output [{where}]",
                        hint="return o_proj's output, [num_tokens, hidden]")
            expected = mlp(x)
            got = call_student(tag, mlp_forward, mlp, x.clone())
            if isinstance(got, torch.Tensor) and got.shape == expected.shape and got.dtype == expected.dtype \
                    and not torch.allclose(got, expected, **TOL32):
                fail(tag, f"mlp_forward differs from the reference [hidden {hidden}, intermediate {inter}, "
                          f"{len(positions)} tokens]", _mlp_hint(got, mlp, x))
            check_close(tag, got, expected, **TOL32, what=f"mlp_forward output [hidden {hidden}]",
                        hint="return down_proj's output, [num_tokens, hidden]")
    ok(tag)


# -- E3.3 loading packed weights --------------------------------------------------------------------------


def _find_source(block, sources):
    for name, tensor in sources.items():
        if block.shape == tensor.shape and torch.equal(block, tensor.to(block.dtype)):
            return name
    return None


def _check_packed(tag, param, expected, regions, sources, what, hint):
    """Compare a fused parameter with the expected one, region by region, naming what went wrong."""
    if torch.equal(param, expected):
        return
    for shard, (offset, size) in regions.items():
        rows = param.narrow(0, offset, size)
        if torch.equal(rows, expected.narrow(0, offset, size)):
            continue
        span = f"rows {offset}..{offset + size - 1}"
        if torch.isnan(rows).all():
            fail(tag, f"{what}: {span}, where shard {shard!r} belongs, were never written", hint)
        src = _find_source(rows, sources)
        if src is not None:
            fail(tag, f"{what}: {span}, where shard {shard!r} belongs, hold the weights of shard {src!r}", hint)
        fail(tag, f"{what}: {span}, where shard {shard!r} belongs, hold the wrong values", hint)


_COPY_HINT = ("copy into the parameter's own rows: param.data.narrow(0, offset, size).copy_(loaded_weight) (copy_ "
              "casts to the parameter's dtype); rebinding param.data swaps the parameter's memory for another tensor")


def _call_loader(tag, fn, param, loaded, extra, what):
    """fn(param, loaded_weight, *extra) must write into param's own memory, keep its dtype and shape, and leave
    the checkpoint tensor as it was."""
    before = (param.dtype, tuple(param.shape), param.data_ptr())
    given = loaded.clone()
    call_student(tag, fn, param, given, *extra)
    if (param.dtype, tuple(param.shape)) != before[:2]:
        fail(tag, f"{what}: after loading, the parameter is {tuple(param.shape)} {param.dtype}, it was {before[1]} "
                  f"{before[0]}", _COPY_HINT)
    if param.data_ptr() != before[2]:
        fail(tag, f"{what}: after loading, the parameter no longer uses its own memory (param.data was rebound)",
             _COPY_HINT)
    if not torch.equal(given, loaded):
        fail(tag, f"{what}: your loader changed the checkpoint tensor", "a loader only reads loaded_weight")


def check_packed_loaders(qkv_weight_loader, gate_up_weight_loader) -> None:
    tag = "E3.3"
    gen = fresh_generator()
    rng = _rng(gen)
    for n, (heads, kv_heads, head_dim, hidden, bias) in enumerate([(4, 2, 16, 64, False), (8, 1, 8, 24, False),
                                                                   (4, 4, 8, 40, False), (6, 2, 16, 32, True)]):
        ckpt_dtype = torch.bfloat16 if n % 2 else torch.float32       # a bf16 checkpoint into an fp32 model too
        ref = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=bias)
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        params = [("weight", ref.weight)] + ([("bias", ref.bias)] if bias else [])
        for pname, ref_param in params:
            cols = (hidden,) if pname == "weight" else ()
            sources = {s: torch.randn((rows, *cols), generator=gen).to(ckpt_dtype)
                       for s, rows in (("q", q_size), ("k", kv_size), ("v", kv_size))}
            order = ["q", "k", "v"]
            rng.shuffle(order)
            mine = torch.nn.Parameter(torch.full_like(ref_param, float("nan")), requires_grad=False)
            with torch.no_grad():
                for s in order:
                    ref.weight_loader(ref_param, sources[s], s)
                    _call_loader(tag, qkv_weight_loader, mine, sources[s], (s, q_size, kv_size),
                                 f"qkv_proj.{pname}, shard {s!r} ({str(ckpt_dtype)[6:]} checkpoint)")
            regions = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
            _check_packed(tag, mine.data, ref_param.data, regions, sources,
                          f"qkv_proj.{pname} ({heads} query heads, {kv_heads} KV heads, head_dim {head_dim}; "
                          f"shards loaded in the order {order})",
                          "the fused rows are [q (q_size rows) | k (kv_size rows) | v (kv_size rows)]: shard 'q' "
                          "starts at row 0, 'k' at q_size, 'v' at q_size + kv_size")
    for hidden, inter in [(64, 128), (24, 40), (16, 1)]:
        ref = MergedColumnParallelLinear(hidden, [inter, inter])
        sources = {s: torch.randn(inter, hidden, generator=gen).to(torch.bfloat16 if inter == 40 else torch.float32)
                   for s in (0, 1)}
        order = [1, 0] if rng.random() < 0.5 else [0, 1]
        mine = torch.nn.Parameter(torch.full_like(ref.weight, float("nan")), requires_grad=False)
        with torch.no_grad():
            for s in order:
                ref.weight_loader(ref.weight, sources[s], s)
                _call_loader(tag, gate_up_weight_loader, mine, sources[s], (s, inter),
                             f"gate_up_proj.weight, shard {s} ({str(sources[s].dtype)[6:]} checkpoint)")
        _check_packed(tag, mine.data, ref.weight.data, {0: (0, inter), 1: (inter, inter)}, sources,
                      f"gate_up_proj.weight (intermediate_size {inter}; shards loaded in the order {order})",
                      "shard 0 (gate_proj) fills rows 0..intermediate_size-1, shard 1 (up_proj) the next "
                      "intermediate_size rows")
    ok(tag)


# -- reference answers ------------------------------------------------------------------------------------


def reference_attention_forward(attn, positions, hidden_states):
    """E3.2: `DecoderAttention.forward` as a function of the module."""
    from nanovllm_ref.models.qwen3 import DecoderAttention
    return DecoderAttention.forward(attn, positions, hidden_states)


def reference_mlp_forward(mlp, x):
    """E3.2: `DecoderMLP.forward` as a function of the module."""
    from nanovllm_ref.models.qwen3 import DecoderMLP
    return DecoderMLP.forward(mlp, x)


def reference_qkv_weight_loader(param, loaded_weight, shard_id, q_size, kv_size):
    """E3.3: copy q_proj / k_proj / v_proj (shard "q", "k", "v") into its rows of the fused qkv_proj."""
    offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
    param.data.narrow(0, offset, size).copy_(loaded_weight)


def reference_gate_up_weight_loader(param, loaded_weight, shard_id, intermediate_size):
    """E3.3: copy gate_proj (shard 0) or up_proj (shard 1) into its rows of the fused gate_up_proj."""
    param.data.narrow(0, shard_id * intermediate_size, intermediate_size).copy_(loaded_weight)


def reference_build_model(model_dir: str):
    """E3.4: our Qwen3ForCausalLM with the checkpoint's weights and the torch attention back-end."""
    from transformers import AutoConfig
    from nanovllm_ref.models.qwen3 import Qwen3ForCausalLM
    from nanovllm_ref.utils.loader import load_model
    with quiet():
        model = Qwen3ForCausalLM(AutoConfig.from_pretrained(model_dir))
        load_model(model, model_dir)
    return model.eval()                     # its Attention layers use the torch back-end by default


def reference_prefill_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    """E3.4: logits [num_prompts, vocab] of each prompt's last token, all prompts in one packed forward."""
    return _ref_prefill(model, prompts)


# -- E3.4 the assembled model vs HF transformers ----------------------------------------------------------


@functools.lru_cache(maxsize=None)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM
    with quiet():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)
def _ref_model(path: str):
    return reference_build_model(path)


def hf_last_logits(path: str, prompts: list[list[int]]) -> torch.Tensor:
    """HF transformers' logits at the last position of each prompt, run one prompt at a time."""
    model = hf_model(path)
    with torch.no_grad(), quiet():
        return torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])


def _ref_prefill(model, prompts, *, one_sequence=False, first_token=False):
    lengths = [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p])
    pos = _positions(lengths)
    with _prefill_context([len(ids)] if one_sequence else lengths), torch.no_grad():
        hidden = model(ids, pos)
    ends = torch.tensor(lengths).cumsum(0)
    return model.compute_logits(hidden[ends - torch.tensor(lengths)] if first_token else hidden[ends - 1])


def _logits_hint(got, model, prompts, tol):
    variants = [
        (dict(one_sequence=True), "tell attention where each prompt starts: cu_seqlens = [0, len0, len0 + len1, "
                                  "...]; with one big sequence, tokens attend to the prompts before them"),
        (dict(first_token=True), "take the hidden state of each prompt's *last* token: hidden[cu_seqlens[1:] - 1]"),
    ]
    for kwargs, hint in variants:
        variant = _ref_prefill(model, prompts, **kwargs)
        if got.shape == variant.shape and torch.allclose(got, variant, **tol):
            return hint
    return ("pack the prompts' tokens into one [num_tokens] tensor, positions per prompt, set the prefill context "
            "(cu_seqlens), run the model, and compute logits of each prompt's last token")


def _record_model_inputs(model):
    """Record (input_ids, positions) of every forward of `model` (through its inner `model.model` when it
    has one, so calling either is seen). Returns (calls, handle); call handle.remove() when done."""
    inner = model.model if isinstance(getattr(model, "model", None), torch.nn.Module) else model
    calls = []

    def hook(module, args, kwargs):
        ids = args[0] if len(args) > 0 else kwargs.get("input_ids")
        pos = args[1] if len(args) > 1 else kwargs.get("positions")
        calls.append((ids, pos))
    return calls, inner.register_forward_pre_hook(hook, with_kwargs=True)


def _as_list(t):
    return t.tolist() if isinstance(t, torch.Tensor) else t


def _short(values: list, n: int = 12) -> str:
    return str(values) if len(values) <= n else f"[{', '.join(map(str, values[:n]))}, ...] ({len(values)} values)"


def _check_model_inputs(tag, calls, prompts, where) -> None:
    """What prefill_logits handed the model: one packed forward, tokens in order, positions per prompt."""
    if not calls:
        return                                     # the model was not called through forward: logits decide
    if len(calls) > 1:
        fail(tag, f"prefill_logits ran the model {len(calls)} times [{where}]",
             "pack all prompts into one [num_tokens] batch and run the model once")
    ids, pos = (_as_list(t) for t in calls[0])
    want_ids = [t for p in prompts for t in p]
    want_pos = _positions([len(p) for p in prompts]).tolist()
    if ids != want_ids:
        fail(tag, f"the input_ids handed to the model are {_short(ids)}, expected {_short(want_ids)} [{where}]",
             "input_ids = every prompt's tokens, one prompt after the other, as one [num_tokens] int64 tensor")
    if pos != want_pos:
        if pos == list(range(len(want_pos))):
            hint = ("positions restart at 0 for each prompt: token j of a prompt is at position j, whatever "
                    "its row in the packed batch. (Counted across the batch, the logits come out right here, "
                    "because RoPE scores depend only on distances inside a prompt; but the keys would be "
                    "rotated for the wrong positions, and chapter 04 caches them.)")
        else:
            hint = "positions = 0, 1, ..., len(prompt) - 1 for each prompt, concatenated like input_ids"
        fail(tag, f"the positions handed to the model are {_short(pos)}, expected {_short(want_pos)} [{where}]",
             hint)


def check_prefill_logits(prefill_logits, build_model) -> None:
    tag = "E3.4"
    gen = fresh_generator()
    rng = _rng(gen)
    tol = dict(rtol=1e-4, atol=1e-4)
    with quiet():
        path = tiny_model_dir("qwen3")
        model = call_student(tag, build_model, path)
    ref = _ref_model(path)
    if not isinstance(model, torch.nn.Module):
        fail(tag, f"build_model returned a {type(model).__name__}, expected the model (an nn.Module)",
             "return the Qwen3ForCausalLM you built")
    mine = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        if name not in mine:
            fail(tag, f"build_model's model has no parameter {name}", "build the model with Qwen3ForCausalLM(config)")
        if mine[name].dtype != p.dtype:
            fail(tag, f"build_model's model holds {name} in {mine[name].dtype}, expected {p.dtype}",
                 "build the model in fp32 (the default dtype) and copy the checkpoint into it with load_model")
        if mine[name].shape != p.shape or not torch.equal(mine[name].data.float(), p.data):
            fail(tag, f"build_model's model has wrong weights in {name}",
                 "load the checkpoint with nanovllm_ref.utils.loader.load_model(model, model_dir) (in fp32)")
    vocab = ref.lm_head.weight.shape[0]
    batches = [[[rng.randrange(vocab)]],
               [[rng.randrange(vocab) for _ in range(n)] for n in (rng.randint(10, 24), 1, rng.randint(2, 9))],
               [[rng.randrange(vocab) for _ in range(rng.randint(20, 40))]],
               [[rng.randrange(vocab) for _ in range(rng.randint(2, 6))] for _ in range(3)]]
    for prompts in batches:
        expected = hf_last_logits(path, prompts)
        lens = [len(p) for p in prompts]
        calls, handle = _record_model_inputs(model)
        try:
            with torch.no_grad():
                got = call_student(tag, prefill_logits, model, [list(p) for p in prompts])
        finally:
            handle.remove()
        where = f"{len(prompts)} prompt(s) of {lens} tokens"
        _check_model_inputs(tag, calls, prompts, where)
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and got.dtype == expected.dtype \
                and not torch.allclose(got, expected, **tol):
            bad = ((got - expected).abs() > tol["atol"] + tol["rtol"] * expected.abs()).any(1)
            first = int(bad.nonzero()[0])
            fail(tag, f"logits of prompt {first} ({lens[first]} tokens) differ from HF transformers [{where}]",
                 _logits_hint(got, ref, prompts, tol))
        check_close(tag, got, expected, **tol, what=f"prefill_logits output [{where}]",
                    hint="one row of logits per prompt: [num_prompts, vocab_size], float32")
    ok(tag)


# --- the chapter's exercises (read by grade, export, engine_check, the capstone and the tests) -----------------
from nanovllm_course.common import EnginePart, Exercise, exercises, parts_of  # noqa: E402
from nanovllm_course import export as _export  # noqa: E402

EXERCISES = exercises(
    Exercise("E3.1", check_gqa_attention, ("gqa_attention",), (reference_gqa_attention,)),
    Exercise("E3.2", check_decoder_blocks, ("attention_forward", "mlp_forward"),
             (reference_attention_forward, reference_mlp_forward)),
    # one exercise, two loaders, one check of both (the capstone runs it once)
    Exercise("E3.3", check_packed_loaders, ("qkv_weight_loader", "gate_up_weight_loader"),
             (reference_qkv_weight_loader, reference_gate_up_weight_loader), parts=(
        EnginePart("qkv_weight_loader", "qkv_weight_loader", "E3.3", adapter=_export.one_rank_qkv_loader,
                   check=lambda mod: check_packed_loaders(mod.qkv_weight_loader, mod.gate_up_weight_loader)),
        EnginePart("gate_up_weight_loader", "gate_up_weight_loader", "E3.3", adapter=_export.one_rank_gate_up_loader,
                   check=lambda mod: check_packed_loaders(mod.qkv_weight_loader, mod.gate_up_weight_loader)))),
    Exercise("E3.4", check_prefill_logits, ("prefill_logits", "build_model"),
             (reference_prefill_logits, reference_build_model)),
)
PARTS = parts_of(EXERCISES)
