"""The model maker's sampling defaults: generation_config.json's temperature, top_k, top_p, min_p,
repetition_penalty and max_new_tokens, applied where a request leaves a field out (vLLM's
`generation_config="auto"`, its default; vllm/config/model.py, `get_diff_sampling_param`).

A chat checkpoint often ships such defaults (a Qwen3 folder: temperature 0.6, top_k 20, top_p 0.95).
`LLM.generate(prompts)` with no SamplingParams, `LLM.chat`, and the server's omitted fields then use them, as
vLLM does; a SamplingParams you build yourself is never changed.

Where they come from (`Config.generation_config`):
- "auto": the model folder's generation_config.json (none there: no defaults);
- "vllm": none (the SamplingParams defaults alone);
- a folder path: that folder's generation_config.json.
`Config.override_generation_config` (a dict of the same keys, HF's names) is laid over whichever it is.

The file is read with transformers' GenerationConfig and only what it sets away from GenerationConfig's own
defaults counts (`to_diff_dict`, as vLLM reads it). `do_sample` is not read (vLLM neither): a file with
`do_sample: false` and a temperature still gives that temperature. Every value is checked once, as a
SamplingParams field, when the Config is made: a bad one is a ValueError naming the file and the key.
"""
import os

from nanovllm_ref.errors import RequestError
from nanovllm_ref.sampling_params import SamplingParams

# generation_config.json key -> SamplingParams field (HF's max_new_tokens is vLLM's max_tokens)
GENERATION_KEYS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
SOURCES = ("auto", "vllm")


def _file_values(folder: str) -> dict:
    """The keys the folder's generation_config.json sets away from transformers' defaults ({} with no file)."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    from transformers import GenerationConfig
    try:
        return GenerationConfig.from_pretrained(folder).to_diff_dict()
    except Exception as exc:          # transformers' own validation errors are not ValueErrors
        raise ValueError(f"cannot read {path}: {' '.join(str(exc).split())}") from exc


def read_sampling_defaults(model: str, generation_config: str = "auto", override: dict | None = None) -> dict:
    """SamplingParams keyword arguments (field -> value) that the model's generation config sets.

    model: the model folder. generation_config: "auto", "vllm" or a folder holding generation_config.json.
    override: None or a dict of GENERATION_KEYS keys (HF's names, e.g. {"temperature": 0.2,
    "max_new_tokens": 128}) laid over the file's values. Returns e.g. {"temperature": 0.6, "top_k": 20}.
    Raises TypeError/ValueError naming the argument, the file or the key: a source that is neither a name
    nor a folder with the file, an override key the engine does not take, a value SamplingParams refuses.
    """
    if not isinstance(generation_config, (str, os.PathLike)):
        raise TypeError(f"generation_config must be 'auto', 'vllm' or a folder path, got "
                        f"{type(generation_config).__name__}")
    source = os.fspath(generation_config)
    if override is not None and not isinstance(override, dict):
        raise TypeError(f"override_generation_config must be a dict such as {{'temperature': 0.7}}, got "
                        f"{type(override).__name__}")
    unknown = sorted(set(override or {}) - set(GENERATION_KEYS), key=str)
    if unknown:
        raise ValueError(f"override_generation_config keys {unknown} are not sampling defaults the engine takes; "
                         f"allowed: {list(GENERATION_KEYS)}")
    if source == "vllm":
        values, where = {}, None
    elif source == "auto":
        values, where = _file_values(model), os.path.join(model, "generation_config.json")
    elif os.path.isfile(os.path.join(source, "generation_config.json")):
        values, where = _file_values(source), os.path.join(source, "generation_config.json")
    else:
        raise ValueError(f"generation_config must be 'auto' (the model folder's generation_config.json), 'vllm' "
                         f"(no defaults) or a folder holding generation_config.json, got {source!r}")
    values = {k: values[k] for k in GENERATION_KEYS if values.get(k) is not None}
    origin = {k: where for k in values}
    for k, v in (override or {}).items():
        values[k], origin[k] = v, "override_generation_config"
    defaults = {}
    for key, value in values.items():
        field = GENERATION_KEYS[key]
        try:                          # each value alone, so the message names the key that is wrong
            SamplingParams(**{field: value})
        except RequestError as exc:
            fix = ("fix the dict" if origin[key] == "override_generation_config" else
                   "fix the file, or pass generation_config='vllm' to leave its defaults out")
            raise ValueError(f"{origin[key]} sets {key}={value!r}, which is not a sampling default the engine "
                             f"takes ({exc.message}); {fix}") from exc
        defaults[field] = value
    # canonical values (top_k -1 -> 0, a tiny temperature -> 0), as the SamplingParams the engine runs holds them
    made = SamplingParams(**defaults)
    return {field: getattr(made, field) for field in defaults}


def describe(defaults: dict, generation_config: str) -> str:
    """One start-up line saying which defaults a request that leaves the field out gets ('' when none)."""
    if not defaults:
        return ""
    shown = ", ".join(f"{k}={v!r}" for k, v in defaults.items())
    return (f"sampling defaults from the model's generation config ({generation_config}): {shown}; they apply "
            "where a request leaves the field out (generation_config='vllm' turns them off)")
