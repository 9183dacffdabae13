"""Model definitions. `get_model_class(hf_config)` maps config.json's architecture to our class."""


def get_model_class(hf_config):
    archs = getattr(hf_config, "architectures", None) or []
    from nanovllm_ref.models.llama import LlamaForCausalLM
    from nanovllm_ref.models.qwen3 import Qwen3ForCausalLM
    table = {"Qwen3ForCausalLM": Qwen3ForCausalLM, "LlamaForCausalLM": LlamaForCausalLM}
    for arch in archs:
        if arch in table:
            return table[arch]
    raise ValueError(f"unsupported architecture {archs}; supported: {sorted(table)}")
