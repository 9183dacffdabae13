"""Engine configuration: the knobs of `LLM(model, **engine_args)` (chapter 00/07).

Names follow vLLM / upstream nano-vllm `config.py`. Every value is checked here, before anything is
allocated, so a bad argument fails fast with a ValueError or TypeError that names it.

A Config is plain data: frozen once built. Two fields are read from the model folder, not given
(`hf_config`, `eos`); what the engine works out at start-up (the KV cache's size, the tokenizer's end id)
goes into a copy (`Config.derived`), so the object a caller built never changes.
"""
import copy
import functools
import json
import numbers
import os
from dataclasses import dataclass, field, fields

from nanovllm_ref.utils.checks import is_finite

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM")
DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")


def _check_int(name, value, low, high=None):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {rng}, got {value}")


@dataclass(frozen=True)
class Config:
    """All engine arguments. `model` is a folder holding config.json, *.safetensors and the tokenizer.

    max_num_batched_tokens: token budget of one prefill step; longer prompts are chunked.
    max_num_seqs: most sequences in one batch (also the largest CUDA-graph batch).
    max_model_len: longest sequence (prompt + completion). None (the default): the model's
        max_position_embeddings, at most 4096. A value above max_position_embeddings is refused.
    gpu_memory_utilization: fraction of GPU memory the engine may use in all (weights + activations + KV).
    tensor_parallel_size: number of processes (GPUs, or CPU ranks over gloo) sharing each layer.
    enforce_eager: never use CUDA graphs.
    max_prefill_graph_tokens: the largest prefill step (in tokens) that runs as a CUDA graph
        (engine/prefill_graph.py; vLLM's max_cudagraph_capture_size plays the same part). Larger prefill steps
        run eagerly. 0 turns prefill graphs off; they are also off without decode graphs (CPU, enforce_eager)
        and where the engine plan cannot run them (nanovllm_ref.Parts.resolve says why at start-up).
    decode_kernels: "auto" (default): on CUDA the model uses the hand-written Triton kernels (fused add +
        RMSNorm, q/k-norm + RoPE + KV store, small-batch GEMMs with split-K and SiLU epilogues;
        utils/fusion.FusedKernels, chosen by nanovllm_ref.Parts.resolve) wherever the parts are the reference
        ones; "off": the same model with cuBLAS GEMMs and the compiled element-wise ops only (for comparisons);
        "persistent": "auto" plus a decode step of one sequence as one persistent kernel
        (kernels/persistent_decode.py; opt-in: on the H200 it is level with the layers' kernels, and its grid
        barriers need the whole GPU); attention_backend "auto" then picks triton. Refused by name without CUDA
        and Triton, with tensor_parallel_size > 1, another attention back-end, linear biases, replaced parts
        or graph sizes without 1.
        CPU engines use none.
    async_scheduling: schedule and launch step n+1 while the device still runs step n, the sampled ids staying
        on the device (engine/llm_engine.py). None (default): on with CUDA when the engine can (one process,
        the reference scheduler), else off; True: on (refused by name where it cannot run); False: off.
    kvcache_block_size: token slots per KV-cache block (any int >= 1).
    num_kvcache_blocks: -1 = size the cache from memory; > 0 = exactly this many blocks. In the engine's
        derived copy (`llm.config`) it is the size the cache got.
    device: "auto" (cuda if available), "cuda" or "cpu". dtype: "auto" (the checkpoint's dtype on GPU,
        float32 on CPU), "float32", "float16" or "bfloat16".
    attention_backend: "auto" | "flash_attn" | "triton" | "torch" | "cpu" (see nanovllm_ref/attn).
    cpu_kvcache_space_gib: KV-cache budget on CPU, in GiB (like vLLM's VLLM_CPU_KVCACHE_SPACE).
    enable_prefix_caching: share full KV blocks between requests with equal prefixes.
    seed: the engine's own seed: each request without a `SamplingParams.seed` gets one drawn from it, in
        arrival order, and dummy weights come from it. torch's global generator is never touched, and a
        request's samples do not depend on the rest of its batch (layers/sampler.py).
    load_format: "auto" reads the safetensors checkpoint (see utils/loader.py); "dummy" fills the weights with random numbers (vLLM's name),
        for benchmarks of a model shape whose weights are not at hand.
    generation_config: where the sampling defaults come from (nanovllm_ref/sampling_defaults.py, vLLM's
        names): "auto" (default) the model folder's generation_config.json, "vllm" none, or a folder holding
        generation_config.json. They apply to `generate` / `chat` without SamplingParams and to the server's
        omitted fields (`LLM.get_default_sampling_params()`); a SamplingParams you pass is never changed.
    override_generation_config: None or a dict of those keys (temperature, top_k, top_p, min_p,
        repetition_penalty, max_new_tokens) laid over them, e.g. {"temperature": 0.2}.
    """
    model: str
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    max_prefill_graph_tokens: int = 4096
    decode_kernels: str = "auto"
    async_scheduling: bool | None = None
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    cpu_kvcache_space_gib: float = 1.0
    enable_prefix_caching: bool = True
    seed: int = 0
    load_format: str = "auto"
    generation_config: str = "auto"
    override_generation_config: dict | None = field(default=None, hash=False)
    # Read from the model folder, never passed: the HF config, and the stop ids as HF generate and vLLM use
    # them (config.json's eos_token_id, then generation_config.json's, where real chat checkpoints list their
    # end-of-turn ids; the engine's derived copy adds the tokenizer's eos).
    hf_config: object = field(init=False, repr=False, compare=False)
    eos: frozenset = field(init=False)
    # SamplingParams field -> value, from generation_config (+ override_generation_config), read-only; see
    # nanovllm_ref/sampling_defaults.py
    sampling_defaults: dict = field(init=False, hash=False)

    def __post_init__(self):
        _set = functools.partial(object.__setattr__, self)      # frozen: normalised values are set once, here
        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(f"model must be a path to a model folder, got {type(self.model).__name__}")
        _set("model", os.fspath(self.model))
        if not os.path.isdir(self.model):
            raise ValueError(f"model folder not found: {self.model!r} (for the real model run "
                             "`python -m nanovllm_ref download smollm2`)")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"model folder {self.model!r} has no config.json")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "tensor_parallel_size",
                     "kvcache_block_size", "num_kvcache_blocks", "seed", "max_prefill_graph_tokens"):
            if isinstance(getattr(self, name), numbers.Integral) and not isinstance(getattr(self, name), bool):
                _set(name, int(getattr(self, name)))      # numpy ints become plain ints
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 8)
        _check_int("kvcache_block_size", self.kvcache_block_size, 1)
        _check_int("seed", self.seed, 0, 2**63 - 1)
        _check_int("max_prefill_graph_tokens", self.max_prefill_graph_tokens, 0, 65536)
        for name in ("enforce_eager", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise TypeError(f"async_scheduling must be None (auto) or a bool, got {type(self.async_scheduling).__name__}")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling=True needs tensor_parallel_size=1 (the workers' inputs come from "
                             "rank 0's host); leave it None or False")
        if isinstance(self.num_kvcache_blocks, bool) or not isinstance(self.num_kvcache_blocks, int):
            raise TypeError(f"num_kvcache_blocks must be an int, got {type(self.num_kvcache_blocks).__name__}")
        if self.num_kvcache_blocks < 1 and self.num_kvcache_blocks != -1:
            raise ValueError(f"num_kvcache_blocks must be -1 (auto) or an int >= 1, got {self.num_kvcache_blocks!r}")
        for name, ok, rng in (("gpu_memory_utilization", lambda v: 0 < v <= 1, "in (0, 1]"),
                              ("cpu_kvcache_space_gib", lambda v: 0 < v < 2**20, "in (0, 2**20) GiB")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"{name} must be a number {rng}, got {type(v).__name__}")
            if not is_finite(v) or not ok(v):
                raise ValueError(f"{name} must be a number {rng}, got {v!r}")
            _set(name, float(v))
        if self.decode_kernels not in ("auto", "off", "persistent"):
            raise ValueError(f"decode_kernels must be 'auto', 'off' or 'persistent', got {self.decode_kernels!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        from nanovllm_ref.attn import BACKENDS
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")

        config_path = os.path.join(self.model, "config.json")
        try:
            with open(config_path) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {config_path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"{config_path} must hold a JSON object, got {type(raw).__name__}")
        archs = raw.get("architectures") or []
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ValueError(f"unsupported architecture {archs} in {self.model}/config.json; "
                             f"supported: {SUPPORTED_ARCHITECTURES}")
        from transformers import AutoConfig
        try:
            hf = AutoConfig.from_pretrained(self.model)
        except Exception as exc:      # transformers' own validation errors are not ValueErrors
            reason = " ".join(str(exc).split())
            raise ValueError(f"{config_path} is not a valid {archs[0]} config (transformers: {reason})") from exc
        _set("hf_config", hf)
        if self.max_model_len is None:
            _set("max_model_len", min(4096, hf.max_position_embeddings))
        elif self.max_model_len > hf.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} is more than the model's "
                             f"max_position_embeddings={hf.max_position_embeddings} ({config_path}); "
                             "the model was not trained for longer sequences")
        tp = self.tensor_parallel_size
        kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        if hf.num_attention_heads % tp or kv_heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide num_attention_heads "
                             f"({hf.num_attention_heads}) and num_key_value_heads ({kv_heads})")
        if hf.vocab_size % tp or hf.intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide vocab_size ({hf.vocab_size}) and "
                             f"intermediate_size ({hf.intermediate_size})")
        check_model_config(hf)
        _set("eos", frozenset(_token_ids("config.json eos_token_id", hf.eos_token_id)
                              | _token_ids("generation_config.json eos_token_id", _generation_eos(self.model))))
        from nanovllm_ref.sampling_defaults import read_sampling_defaults
        if isinstance(self.generation_config, os.PathLike):
            _set("generation_config", os.fspath(self.generation_config))
        if self.override_generation_config is not None:
            _set("override_generation_config", dict(self.override_generation_config)
                 if isinstance(self.override_generation_config, dict) else self.override_generation_config)
        _set("sampling_defaults", read_sampling_defaults(self.model, self.generation_config,
                                                         self.override_generation_config, hf))

    # Pickled (to a tensor-parallel worker, to the core process), a Config carries its hf_config as a ModelConfig:
    # the same attributes with the same values, in a class of this module, so the process that unpickles it
    # imports no transformers (about 1.2 s of CPU; a worker needs only the numbers). A copy keeps the object.
    def __getstate__(self):
        state = dict(self.__dict__)
        hf = state.get("hf_config")
        if hf is not None and not isinstance(hf, ModelConfig):
            state["hf_config"] = ModelConfig.of(hf)
        return state

    def __copy__(self):
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo):
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    @classmethod
    def argument_names(cls) -> list[str]:
        """The engine arguments a caller may pass (every field but those read from the model folder)."""
        return [f.name for f in fields(cls) if f.init]

    def derived(self, *, num_kvcache_blocks: int | None = None, extra_eos=()) -> "Config":
        """A copy with what the engine works out at start-up: the KV cache's size in blocks, and more stop
        ids (the tokenizer's eos). This Config is left as it was."""
        new = copy.copy(self)
        if num_kvcache_blocks is not None:
            _check_int("num_kvcache_blocks", num_kvcache_blocks, 1)
            object.__setattr__(new, "num_kvcache_blocks", int(num_kvcache_blocks))
        object.__setattr__(new, "eos", self.eos | frozenset(int(t) for t in extra_eos))
        return new


class ModelConfig:
    """An HF config's attributes (its instance attributes: what config.json set and transformers filled in), as
    a plain object: `Config.hf_config` in a process that received the Config pickled. The engine reads only
    attributes of the HF config, and `getattr(c, name, default)` finds each here as there. Made by
    `ModelConfig.of`, which gives back the HF object itself when a value is not plain data (then the other
    process imports transformers, as it did before)."""

    def __init__(self, class_name: str, values: dict):
        self.__dict__.update(values)
        self.__dict__["_hf_class_name"] = class_name

    @staticmethod
    def of(hf):
        values = dict(vars(hf))
        if not all(isinstance(k, str) and _plain(v) for k, v in values.items()):
            return hf
        return ModelConfig(type(hf).__name__, copy.deepcopy(values))

    def __reduce__(self):
        values = {k: v for k, v in vars(self).items() if k != "_hf_class_name"}
        return ModelConfig, (self._hf_class_name, values)

    def __repr__(self):
        shown = ", ".join(f"{k}={v!r}" for k, v in sorted(vars(self).items()) if not k.startswith("_"))
        return f"ModelConfig[{self._hf_class_name}]({shown})"


def _plain(value) -> bool:
    """True for JSON-like data (None, bool, int, float, str; lists, tuples and str-keyed dicts of them) and
    torch dtypes: what pickles without importing transformers."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return type(value) in (type(None), bool, int, float, str)
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return all(_plain(v) for v in value)
    if type(value) in (dict,):
        return all(isinstance(k, (str, int)) and _plain(v) for k, v in value.items())
    return type(value).__module__ == "torch" and type(value).__name__ == "dtype"


def rope_theta(hf_config) -> float:
    """RoPE base from an HF config: `rope_theta`, or transformers 5's `rope_parameters["rope_theta"]`."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(hf_config, "rope_theta", 10000.0))


def _token_ids(where: str, value) -> set[int]:
    """An eos_token_id setting (None, an int or a list of ints) as a set; ValueError naming `where`."""
    if value is None:
        return set()
    values = [value] if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value
    if not isinstance(values, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, numbers.Integral)
                                                     or v < 0 for v in values):
        raise ValueError(f"{where} must be a token id or a list of token ids, got {value!r}")
    return {int(v) for v in values}


def _generation_eos(model: str):
    """eos_token_id of the folder's generation_config.json (read with transformers' GenerationConfig), or None."""
    path = os.path.join(model, "generation_config.json")
    if not os.path.isfile(path):
        return None
    from transformers import GenerationConfig
    try:
        return GenerationConfig.from_pretrained(model).eos_token_id
    except Exception as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc


# The config.json keys of the Qwen3 and Llama architectures that change the forward pass, and what the
# engine does with each (README, "Config keys"). Everything else there (initializer_range, use_cache,
# attention_dropout, pretraining_tp, pad_token_id, dtype, ...) does not change inference in HF either.
def check_model_config(hf) -> None:
    """Refuse, by name, every config setting the engine cannot honour; drop those HF ignores too.

    Implemented: vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, head_dim, rms_norm_eps, attention_bias, mlp_bias (Llama only: HF's Qwen3 MLP
    has no bias, so the key is ignored for Qwen3), tie_word_embeddings, max_position_embeddings, rope_theta
    and RoPE scaling of type default / linear / yarn. Refused with ValueError: hidden_act other than silu,
    sliding-window layers (Qwen3 use_sliding_window with sliding_window, or layer_types), other RoPE
    scaling types, partial_rotary_factor != 1, and quantization_config.
    """
    act = getattr(hf, "hidden_act", "silu")
    if act not in ("silu", "swish"):                 # HF's ACT2FN maps both names to SiLU
        raise ValueError(f"config.json hidden_act={act!r} is not supported (the engine's MLP is SiLU-and-mul); "
                         "supported: 'silu'")
    layer_types = getattr(hf, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError("config.json asks for sliding-window attention (use_sliding_window / sliding_window / "
                         f"layer_types = {sorted(set(layer_types))}); nanovllm_ref implements full attention only")
    if getattr(hf, "quantization_config", None):
        raise ValueError("config.json quantization_config is set; nanovllm_ref loads unquantized weights only")
    if "Qwen3ForCausalLM" in (hf.architectures or []) and getattr(hf, "mlp_bias", False):
        hf.mlp_bias = False                          # HF's Qwen3 ignores mlp_bias: so do we
    from nanovllm_ref.layers.rope_scaling import rope_frequencies, rope_parameters_of
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    rope_frequencies(head_dim, rope_theta(hf), rope_parameters_of(hf), hf.max_position_embeddings)
