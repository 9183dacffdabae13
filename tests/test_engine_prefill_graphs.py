"""Prefill CUDA graphs (engine/prefill_graph.py), checked on the CPU.

A graph's replay is the captured step run again, so the CPU tests replace the capture with an eager replay of
the same `_step` (EagerPrefillReplay): the whole data path of a graph prefill (the padded packed buffer, the
views, the padded token count and sequence count, attention through the block tables, the last-token rows) runs
without CUDA. What is held:
- greedy ids equal HF's through the graph route, for the cpu and the Triton back-ends: single prompts, several
  prompts at once, a prefix-cache hit (keys partly from cached blocks), chunked prompts;
- which steps take the graph: at most the largest size in tokens, at most MAX_SEQS sequences, no
  prompt_logprobs; the others run eagerly and still equal HF;
- the packed buffer holds exactly the step plus its padding (slot -1, empty sequences, -1 tables);
- the plan turns the graphs on only where they can run and says why not; the config refuses bad values by name.
"""
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine_helpers import LLM, hf_greedy, tiny_dir
from nanovllm_ref import Parts, SamplingParams
from nanovllm_ref.config import Config
from nanovllm_ref.engine.prefill_graph import MAX_SEQS, PrefillGraphRunner, StaticPrefillInputs, prefill_graph_sizes
from nanovllm_ref.engine.sequence import Sequence
from nanovllm_ref.engine.step_batch import StepBuilder

SIZES = (16, 32, 64, 128)


class EagerPrefillReplay(PrefillGraphRunner):
    """A PrefillGraphRunner whose "graph" runs the captured step again, eagerly; it counts its replays by size."""

    def _record(self, t, pool):
        def replay():
            self.replayed.append(t)
            self._step(t)
        self.replayed = getattr(self, "replayed", [])
        return SimpleNamespace(replay=replay), None


def _graph_llm(**kw):
    args = dict(enforce_eager=True, max_num_seqs=32, kvcache_block_size=16, max_model_len=256)
    llm = LLM(tiny_dir("qwen3"), **{**args, **kw})
    llm.model_runner.capture_prefill_graphs(EagerPrefillReplay, sizes=SIZES)
    graphs = llm.model_runner.prefill_graphs
    graphs.replayed.clear()                  # the capture's own warm-up runs are not steps
    return llm, graphs


def _prompts(seed, n, lo=3, hi=30):
    g = random.Random(seed)
    return [[g.randrange(1, 200) for _ in range(g.randrange(lo, hi))] for _ in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_graph_prefill_equals_hf_alone_together_and_with_a_cached_prefix(backend):
    path = tiny_dir("qwen3")
    llm, graphs = _graph_llm(attention_backend=backend)
    for p in _prompts(1, 2):                                     # one prompt a step: 3-29 tokens pad to 16 or 32
        assert llm.generate([p], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(path, p, 6)
    assert graphs.replayed and set(graphs.replayed) <= {16, 32}, graphs.replayed
    graphs.replayed.clear()
    prompts = _prompts(11, 4)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)      # four new prompts in one prefill step
    assert [o["token_ids"] for o in outs] == [hf_greedy(path, p, 6) for p in prompts]
    assert graphs.replayed[0] == next(s for s in SIZES if s >= sum(map(len, prompts)))
    # A prefix-cache hit: the same 40-token prompt again, its first two 16-token blocks cached, so the graph's
    # attention reads 32 of its keys from blocks an earlier request wrote.
    long = _prompts(2, 1, 40, 41)[0]
    graphs.replayed.clear()
    first = llm.generate([long], GREEDY, use_tqdm=False)[0]
    assert graphs.replayed == [64], graphs.replayed          # all 40 tokens
    graphs.replayed.clear()
    again = llm.generate([long], GREEDY, use_tqdm=False)[0]
    assert first["token_ids"] == again["token_ids"] == hf_greedy(path, long, 6)
    assert graphs.replayed == [16], graphs.replayed          # the 8 after the cached 32
    llm.exit()


def test_chunked_prompts_run_each_chunk_in_a_graph_and_equal_hf():
    path = tiny_dir("qwen3")
    llm, graphs = _graph_llm(max_num_batched_tokens=24, enable_prefix_caching=False)
    prompts = _prompts(3, 2, 50, 70)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [hf_greedy(path, p, 6) for p in prompts]
    assert len(graphs.replayed) >= 5 and set(graphs.replayed) == {32}, graphs.replayed   # 24-token chunks pad to 32
    llm.exit()


def test_steps_a_graph_cannot_take_run_eagerly_and_still_equal_hf():
    """Larger than the largest graph, more sequences than MAX_SEQS, prompt_logprobs: eager, same answers."""
    path = tiny_dir("qwen3")
    llm, graphs = _graph_llm()
    big = _prompts(4, 1, 140, 150)                           # > 128 tokens
    many = [[5 + i, 6, 7] for i in range(MAX_SEQS + 1)]      # 17 prompts of 3 tokens: 51 tokens
    for prompts in (big, many):
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o["token_ids"] for o in outs] == [hf_greedy(path, p, 6) for p in prompts]
    assert graphs.replayed == [], graphs.replayed
    p = _prompts(5, 1)[0]
    with_logprobs = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    out = llm.generate([p], with_logprobs, use_tqdm=False)[0]
    assert graphs.replayed == [] and out["token_ids"] == hf_greedy(path, p, 6) and len(out.prompt_logprobs) == len(p)
    assert llm.generate([many[0]], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(path, many[0], 6)
    assert graphs.replayed == [16], "a 3-token prompt alone takes the 16-token graph again"
    llm.exit()


def _seq(tokens, table, cached=0, block_size=4):
    seq = Sequence(list(tokens), block_size, SamplingParams(temperature=0))
    seq.block_table = list(table)
    seq.num_cached_tokens = cached
    seq.num_scheduled_tokens = len(tokens) - cached
    return seq


def test_pack_writes_the_step_and_pads_the_rest():
    config = SimpleNamespace(kvcache_block_size=4, eos=frozenset({0}), hf_config=SimpleNamespace(vocab_size=300))
    builder = StepBuilder(Parts().prepare_prefill, Parts().prepare_decode, config)
    inputs = StaticPrefillInputs(max_tokens=16, max_seqs=4, max_blocks=3, device="cpu")
    a = _seq(range(10, 19), [7, 2, 5], cached=4)             # 5 new tokens after a 4-token cached prefix
    b = _seq(range(20, 23), [1])                              # 3 tokens, no prefix
    batch = builder.build([a, b], True)
    assert inputs.fits(batch)
    h = inputs.views(inputs.pack(batch))
    h["block_tables"] = h["block_tables"].reshape(4, 3)
    assert h["input_ids"].tolist() == [14, 15, 16, 17, 18, 20, 21, 22] + [0] * 8
    assert h["positions"].tolist() == [4, 5, 6, 7, 8, 0, 1, 2] + [0] * 8
    assert h["slot_mapping"].tolist() == [8, 9, 10, 11, 20, 4, 5, 6] + [-1] * 8
    assert h["cu_seqlens_q"].tolist() == [0, 5, 8, 8, 8] and h["cu_seqlens_k"].tolist() == [0, 9, 12, 12, 12]
    assert h["last_rows"].tolist() == [4, 7, 0, 0]
    assert h["block_tables"].tolist() == [[7, 2, 5], [1, -1, -1], [-1, -1, -1], [-1, -1, -1]]
    # A smaller step after it leaves nothing of the larger one behind.
    h = inputs.views(inputs.pack(builder.build([_seq([3, 4], [6])], True)))
    assert h["slot_mapping"].tolist() == [24, 25] + [-1] * 14 and h["cu_seqlens_q"].tolist() == [0, 2, 2, 2, 2]
    assert h["block_tables"][:3].tolist() == [6, -1, -1] and set(h["block_tables"][3:].tolist()) == {-1}
    too_many = builder.build([_seq([1, 2], [i]) for i in range(5)], True)
    too_long = builder.build([_seq(range(1, 18), [0, 1, 2, 3, 4])], True)
    assert not inputs.fits(too_many) and not inputs.fits(too_long)


def test_prefill_graph_sizes_stop_at_the_limit_and_at_the_step_budget():
    assert prefill_graph_sizes(4096, 16384) == (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
    assert prefill_graph_sizes(4096, 300) == (16, 32, 64, 128, 256, 384)
    assert prefill_graph_sizes(100, 16384) == (16, 32, 64)
    assert prefill_graph_sizes(0, 16384) == ()


def test_the_plan_turns_prefill_graphs_on_only_where_they_run_and_says_why_not(monkeypatch):
    from nanovllm_ref.kernels import numerics
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(numerics, "pdl_available", lambda device: True)
    path = tiny_dir("qwen3")

    def plan(device="cuda", world_size=1, **kw):
        config = Config(path, kvcache_block_size=16, max_model_len=64, max_num_seqs=8, **kw)
        return Parts().resolve(config, device, torch.bfloat16, world_size)

    on = plan(max_num_batched_tokens=1000)
    assert on.prefill_graph_sizes == (16, 32, 64, 128, 256, 384, 512, 768, 1024)
    assert "prefill CUDA graphs: token counts 16, 32, 64, 128, ..., 1024 (9 graphs), up to 16 sequences" in on.describe()
    for kw, why in ((dict(enforce_eager=True), "no CUDA graphs"), (dict(max_prefill_graph_tokens=0), "max_prefill_graph_tokens=0"),
                    (dict(world_size=2), "tensor parallel"), (dict(attention_backend="torch"), "the torch attention back-end")):
        p = plan(**kw)
        assert p.prefill_graph_sizes == () and why in p.prefill_graphs_off and f"prefill CUDA graphs: off ({why}" in p.describe()
    assert plan(device="cpu").prefill_graph_sizes == ()


@pytest.mark.parametrize("value, error", [(-1, ValueError), (65537, ValueError), (True, TypeError), ("4096", TypeError),
                                          (1.5, TypeError)])
def test_config_refuses_a_bad_max_prefill_graph_tokens_by_name(value, error):
    with pytest.raises(error, match="max_prefill_graph_tokens"):
        Config(tiny_dir("qwen3"), max_prefill_graph_tokens=value)
    assert Config(tiny_dir("qwen3"), max_prefill_graph_tokens=np.int64(512)).max_prefill_graph_tokens == 512
