"""The public entry point, as in vLLM: `LLM(model_path, **engine_args).generate(prompts, sampling_params)`."""
from nanovllm_ref.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    """An offline inference engine over a local model folder (config.json + *.safetensors + tokenizer).

    See `nanovllm_ref.config.Config` for the engine arguments and `LLMEngine.generate` for the call.
    """
