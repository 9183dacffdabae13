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
`Config.override_generation_config` (a dict of the same keys, HF's names) is laid over whichever it is; a
key set to None there drops the file's value (vLLM's `--override-generation-config '{"top_k": null}'`).

The file is read with transformers' GenerationConfig and only what it sets away from GenerationConfig's own
defaults counts (`to_diff_dict`, as vLLM reads it); a folder without the file gives what its config.json
sets (`GenerationConfig.from_model_config`, vLLM's fallback; usually nothing). `do_sample` is not read (vLLM neither): a file with
`do_sample: false` and a temperature still gives that temperature. Every value is checked once, as a
SamplingParams field, when the Config is made: a bad one is a ValueError naming the file and the key.
"""
import os

from nanovllm_ref.errors import RequestError
from nanovllm_ref.sampling_params import SamplingParams
from nanovllm_ref.utils.checks import shown

# generation_config.json key -> SamplingParams field (HF's max_new_tokens is vLLM's max_tokens)
GENERATION_KEYS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
OVERRIDE = "override_generation_config"


class ReadOnlyDict(dict):
    """A dict that cannot change once made (`Config.sampling_defaults`: the Config is frozen); it pickles."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("Config.sampling_defaults cannot change; pass override_generation_config to the engine")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self):
        return type(self), (dict(self),)


def _file_values(folder: str, hf_config=None) -> dict:
    """The keys the folder's generation_config.json sets away from transformers' defaults; with no file, those
    of `hf_config` (the folder's config.json, vLLM's fallback), or {} without one."""
    from transformers import GenerationConfig
    path = os.path.join(folder, "generation_config.json")
    try:
        if os.path.isfile(path):
            return GenerationConfig.from_pretrained(folder).to_diff_dict()
        return GenerationConfig.from_model_config(hf_config).to_diff_dict() if hf_config is not None else {}
    except Exception as exc:          # transformers' own validation errors are not ValueErrors
        where = path if os.path.isfile(path) else os.path.join(folder, "config.json")
        raise ValueError(f"cannot read {where}: {' '.join(str(exc).split())}") from exc


def source_of(model: str, generation_config: str) -> str | None:
    """Where the file's defaults come from, as the messages name it (None for "vllm")."""
    if generation_config == "vllm":
        return None
    folder = model if generation_config == "auto" else generation_config
    path = os.path.join(folder, "generation_config.json")
    return path if os.path.isfile(path) or generation_config != "auto" else os.path.join(folder, "config.json")


def read_sampling_defaults(model: str, generation_config: str = "auto", override: dict | None = None,
                           hf_config=None) -> ReadOnlyDict:
    """SamplingParams keyword arguments (field -> value) that the model's generation config sets.

    model: the model folder. generation_config: "auto", "vllm" or a folder holding generation_config.json.
    override: None or a dict of GENERATION_KEYS keys (HF's names, e.g. {"temperature": 0.2,
    "max_new_tokens": 128}) laid over the file's values; a None value drops the file's. hf_config: the
    model's HF config, read when "auto" finds no generation_config.json (vLLM's fallback). Returns e.g.
    {"temperature": 0.6, "top_k": 20}, read-only. Raises TypeError/ValueError naming the argument, the file or
    the key: a source that is neither a name nor a folder with the file, an override key the engine does not
    take, a value SamplingParams refuses.
    """
    if not isinstance(generation_config, (str, os.PathLike)):
        raise TypeError(f"generation_config must be 'auto', 'vllm' or a folder path, got "
                        f"{type(generation_config).__name__}")
    source = os.fspath(generation_config)
    if override is not None and not isinstance(override, dict):
        raise TypeError(f"{OVERRIDE} must be a dict such as {{'temperature': 0.7}}, got {type(override).__name__}")
    unknown = sorted(map(repr, set(override or {}) - set(GENERATION_KEYS)))
    if unknown:
        raise ValueError(f"{OVERRIDE} keys [{', '.join(unknown)}] are not sampling defaults the engine takes; "
                         f"allowed: {list(GENERATION_KEYS)}")
    if source == "vllm":
        values = {}
    elif source == "auto":
        values = _file_values(model, hf_config)
    elif os.path.isfile(os.path.join(source, "generation_config.json")):
        values = _file_values(source)
    else:
        raise ValueError(f"generation_config must be 'auto' (the model folder's generation_config.json), 'vllm' "
                         f"(no defaults) or a folder holding generation_config.json, got {source!r}")
    where = source_of(model, source)
    values = {k: values[k] for k in GENERATION_KEYS if values.get(k) is not None}
    origin = dict.fromkeys(values, where)
    for key, value in (override or {}).items():
        if value is None:             # vLLM drops None after the update: the way to clear one of the file's keys
            values.pop(key, None)
        else:
            values[key], origin[key] = value, OVERRIDE
    defaults = {}
    for key, value in values.items():
        field = GENERATION_KEYS[key]
        try:                          # each value alone, so the message names the key that is wrong
            SamplingParams(**{field: value})
        except RequestError as exc:
            fix = ("fix the dict" if origin[key] == OVERRIDE else
                   "fix the file, or pass generation_config='vllm' to leave its defaults out")
            raise ValueError(f"{origin[key]} sets {key}={shown(value)}, which is not a sampling default the "
                             f"engine takes ({exc.message}); {fix}") from exc
        defaults[field] = value
    # canonical values (top_k -1 -> 0, a tiny temperature -> 0), as the SamplingParams the engine runs holds them
    made = SamplingParams(**defaults)
    return ReadOnlyDict({field: getattr(made, field) for field in defaults})


def describe(defaults: dict, model: str, generation_config: str, override: dict | None) -> str:
    """The start-up line saying which defaults a request that leaves a field out gets ('' when none)."""
    if not defaults:
        return ""
    names = {field: key for key, field in GENERATION_KEYS.items()}
    shown_values = ", ".join(f"{names[k]}={v!r}" for k, v in defaults.items())
    overridden = {GENERATION_KEYS[k] for k, v in (override or {}).items() if v is not None}
    sources = [s for s in (source_of(model, os.fspath(generation_config)) if set(defaults) - overridden else None,
                           OVERRIDE if overridden else None) if s]
    off = ("generation_config='vllm' leaves the file's out" if os.fspath(generation_config) != "vllm"
           else "leave override_generation_config out for none")
    return (f"sampling defaults {shown_values} (from {' and '.join(sources)}) apply where a request leaves the "
            f"field out (LLM.generate without SamplingParams, the server's omitted fields); {off}")
