"""nanovllm_ref as a peer: one back-end with CUDA graphs or eager, a fresh engine for every timed run.

The timed run is `LLM.generate`, as a user runs it; its `generate_stats` count the prefill tokens the run
computed: with no preemption, a run that found nothing cached computes exactly the workload's prompt tokens
(`last_run`).
"""
from nanovllm_bench.machine import project_commit


class RefPeer:
    fresh_per_run = True

    def __init__(self, model_dir: str, engine_args: dict):
        import torch
        self.model_dir, self.engine_args = model_dir, engine_args
        self.device = engine_args.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
        self.llm, self.last_run, self._info = None, None, {}

    def start(self):
        from nanovllm_ref import LLM
        self.llm = LLM(self.model_dir, load_format="dummy", **self.engine_args)
        r = self.llm.model_runner
        self._info = dict(backend=r.backend_name, cuda_graphs=not r.enforce_eager, graph_samples=r.graph_samples,
                          num_kvcache_blocks=self.llm.config.num_kvcache_blocks, engine_args=self.engine_args)

    def generate(self, prompts, max_tokens, temperature) -> int:
        from nanovllm_ref import SamplingParams
        llm = self.llm
        preempted = llm.scheduler.num_preemptions
        sps = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=m) for m in max_tokens]
        outs = llm.generate(prompts, sps, use_tqdm=False)          # as a user runs it
        self.last_run = dict(prompt_tokens=sum(map(len, prompts)), prefill_tokens=llm.generate_stats["prefill"][0],
                             preemptions=llm.scheduler.num_preemptions - preempted)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def reset(self):
        pass                                        # a fresh engine per timed run: nothing to reset

    def info(self) -> dict:
        from importlib.metadata import PackageNotFoundError, version
        try:
            v = version("nanovllm-ref")
        except PackageNotFoundError:
            v = None
        return dict(self._info, versions=dict(peer=v, commit=project_commit()),
                    cache_policy="fresh engine per timed run")

    def close(self):
        if self.llm is not None:
            self.llm.exit()
            self.llm = None
            if self.device == "cuda":
                import torch
                torch.cuda.empty_cache()


def make(options: dict, workload, model_dir: str) -> RefPeer:
    args = dict(options.get("engine_args", {}))
    args.update(attention_backend=options.get("backend", "auto"), enforce_eager=bool(options.get("eager")))
    return RefPeer(model_dir, args)
