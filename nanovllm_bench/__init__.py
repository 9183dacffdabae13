"""The benchmark beside the engine (chapter 11): the workload, its physical floor, and a harness that runs
nanovllm_ref and its peers (vLLM, upstream nano-vllm, HF transformers) each in its own process.

| module      | concept                                                                            |
|-------------|------------------------------------------------------------------------------------|
| workload    | upstream nano-vllm's bench.py workload and the model folder it runs on            |
| floor       | the physical floor (roofline) of a workload, % of floor                            |
| machine     | copy bandwidth and matmul rate measured here, versions, compile counters           |
| peer        | one peer in its own process: warm-up, timed runs, batch-1 (the protocol)           |
| peers/      | nanovllm_ref, vLLM, upstream nano-vllm, HF continuous batching                     |
| harness     | every peer in a child process, rows with reasons, the record (JSON + CSV)          |
| profile     | where a run's time goes: whole `llm.step()` calls, eager kernel profile, graph sweep |
| figures     | the record's figures                                                               |
| cpu         | the CPU benchmark on SmolLM2 against HF `generate`                                 |
| serve       | the online serving benchmark: Poisson arrivals against an OpenAI-compatible server |
| cli         | `python -m nanovllm_bench` (= `python -m nanovllm_ref bench`)                      |
| payload     | builds the multi-part payload (vLLM, nano-vllm, wheels) for the lent GPU machine   |

The engine (nanovllm_ref) imports nothing from here; `python -m nanovllm_ref bench` finds this package
through the entry point it registers (pyproject.toml, nanovllm_ref/plugins.py).
What chapter 11 teaches is importable from here too: `make_workload`, `QWEN3_06B`, `model_stats`,
`physical_floor`, `pct_of_floor`.
"""
from nanovllm_bench.floor import model_stats, pct_of_floor, physical_floor
from nanovllm_bench.workload import QWEN3_06B, make_workload

__all__ = ["QWEN3_06B", "make_workload", "model_stats", "pct_of_floor", "physical_floor"]
