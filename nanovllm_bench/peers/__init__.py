"""The peers the harness can run, each a module with `make(options, workload, model_dir) -> Peer`
(protocol in nanovllm_bench/peer.py), run in a process of its own:

| peer         | module    | row name                               | nothing cached in a timed run          |
|--------------|-----------|----------------------------------------|----------------------------------------|
| nanovllm_ref | ref       | nanovllm_ref[<backend>:<graph|eager>]  | a fresh engine per run                 |
| vllm         | vllm      | vllm                                   | enable_prefix_caching=False            |
| nano-vllm    | upstream  | nano-vllm                              | its prefix-cache map cleared per run   |
| hf           | hf        | hf_transformers[continuous_batching]   | a new continuous-batching manager per run |
"""
