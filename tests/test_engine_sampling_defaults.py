"""The model's sampling defaults (generation_config.json; nanovllm_ref/sampling_defaults.py), as vLLM applies them
with `generation_config="auto"`: `LLM.generate` / `add_request` / `chat` without SamplingParams get them, a
SamplingParams the caller builds is never changed, and a bad source or value is refused by name before the
weights load."""
import json
import os
import shutil

import pytest
from engine_helpers import tiny_dir

from nanovllm_ref import LLM, SamplingParams
from nanovllm_ref.config import Config

ENGINE = dict(device="cpu", max_model_len=128, kvcache_block_size=16)
PROMPTS = [[5, 9, 14, 3], [7, 7, 2, 30, 11]]


def with_generation_config(folder, **keys) -> str:
    """A copy of the tiny Qwen3 checkpoint whose generation_config.json also sets `keys` (the bos/eos/pad ids
    transformers wrote stay)."""
    shutil.copytree(tiny_dir("qwen3"), folder)
    path = os.path.join(folder, "generation_config.json")
    with open(path) as f:
        values = json.load(f)
    values.update(keys)
    with open(path, "w") as f:
        json.dump(values, f)
    return str(folder)


@pytest.mark.parametrize("keys,want", [
    (dict(temperature=0.6, top_k=20, top_p=0.95, do_sample=True), dict(temperature=0.6, top_k=20, top_p=0.95)),
    (dict(max_new_tokens=5), dict(max_tokens=5)),                              # HF's name for max_tokens
    (dict(min_p=0.05, repetition_penalty=1.1), dict(min_p=0.05, repetition_penalty=1.1)),
    (dict(do_sample=False, temperature=0.7), dict(temperature=0.7)),           # do_sample is not read (vLLM)
    (dict(top_k=-1, temperature=1e-7), dict(top_k=0, temperature=0.0)),       # as SamplingParams holds them
    (dict(num_beams=1, length_penalty=1.0), {}),                               # no sampling key: no defaults
])
def test_config_reads_the_sampling_keys_of_generation_config(tmp_path, keys, want):
    folder = with_generation_config(tmp_path / "m", **keys)
    assert Config(folder, device="cpu").sampling_defaults == want


def test_the_tiny_and_real_checkpoints_set_no_defaults():
    """What the course's checkpoints write (bos/eos/pad ids only): generate() stays SamplingParams()."""
    assert Config(tiny_dir("qwen3"), device="cpu").sampling_defaults == {}


def test_vllm_turns_them_off_a_folder_is_read_and_the_override_is_laid_over(tmp_path):
    folder = with_generation_config(tmp_path / "m", temperature=0.6, top_k=20)
    other = with_generation_config(tmp_path / "other", top_p=0.5)
    assert Config(folder, device="cpu", generation_config="vllm").sampling_defaults == {}
    assert Config(folder, device="cpu", generation_config=other).sampling_defaults == {"top_p": 0.5}
    over = Config(folder, device="cpu", override_generation_config={"temperature": 0.2, "max_new_tokens": 9})
    assert over.sampling_defaults == {"temperature": 0.2, "top_k": 20, "max_tokens": 9}
    assert Config(folder, device="cpu", generation_config="vllm",
                  override_generation_config={"top_k": 3}).sampling_defaults == {"top_k": 3}
    # None drops the file's value (vLLM drops None after laying the override over the file)
    assert Config(folder, device="cpu", override_generation_config={"top_k": None}).sampling_defaults == {
        "temperature": 0.6}


def test_without_the_file_config_json_is_read_as_vllm_falls_back(tmp_path):
    folder = with_generation_config(tmp_path / "m")
    os.remove(os.path.join(folder, "generation_config.json"))
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**config, "max_new_tokens": 11}, f)
    assert Config(folder, device="cpu").sampling_defaults == {"max_tokens": 11}
    assert Config(tiny_dir("llama"), device="cpu").sampling_defaults == {}


def test_the_defaults_cannot_change_once_read(tmp_path):
    import copy
    import pickle
    config = Config(with_generation_config(tmp_path / "m", temperature=0.6), device="cpu")
    with pytest.raises(TypeError, match="cannot change; pass override_generation_config"):
        config.sampling_defaults["temperature"] = 2.0
    with pytest.raises(TypeError, match="cannot change"):
        config.sampling_defaults.update(top_k=3)
    for copied in (pickle.loads(pickle.dumps(config)), copy.deepcopy(config), config.derived(extra_eos=[1])):
        assert copied.sampling_defaults == {"temperature": 0.6}
        with pytest.raises(TypeError):
            copied.sampling_defaults.pop("temperature")


@pytest.mark.parametrize("file_keys,args,error,says", [
    ({}, dict(generation_config="nowhere"), ValueError, "generation_config must be 'auto'.*'nowhere'"),
    ({}, dict(generation_config=3), TypeError, "generation_config must be 'auto', 'vllm' or a folder path"),
    ({}, dict(override_generation_config=[("temperature", 1)]), TypeError, "override_generation_config must be a dict"),
    ({}, dict(override_generation_config={"seed": 1, "max_tokens": 3}), ValueError,
     r"keys \['max_tokens', 'seed'\] are not sampling defaults.*allowed:.*max_new_tokens"),
    ({}, dict(override_generation_config={"temperature": -1}), ValueError,
     "override_generation_config sets temperature=-1.*fix the dict"),
    (dict(top_p=0.0), {}, ValueError, r"generation_config.json sets top_p=0.0.*top_p must be.*generation_config='vllm'"),
    # transformers' GenerationConfig refuses this one itself; either way the message names the file and the key
    (dict(max_new_tokens=0), {}, ValueError, "generation_config.json.*max_new_tokens"),
    (dict(repetition_penalty=1e-300), {}, ValueError, "sets repetition_penalty=1e-300"),
    ({}, dict(override_generation_config={"temperature": 10**400}), ValueError,
     r"sets temperature=10{19}\.\.\. \(401 characters\), which"),
])
def test_a_bad_source_or_value_is_refused_by_name(tmp_path, file_keys, args, error, says):
    folder = with_generation_config(tmp_path / "m", **file_keys)
    with pytest.raises(error, match=says):
        Config(folder, device="cpu", **args)


def test_an_unreadable_generation_config_is_named(tmp_path):
    folder = with_generation_config(tmp_path / "m")
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        f.write("{not json")
    for source in ("auto", "vllm"):          # "vllm" too: the file's eos ids are read whatever the source
        with pytest.raises(ValueError, match="cannot read .*generation_config.json"):
            Config(folder, device="cpu", generation_config=source)


@pytest.fixture(scope="module")
def sampled_pair(tmp_path_factory):
    """Two engines with the same seed: one whose file sets sampling defaults, one told to leave them out."""
    folder = with_generation_config(tmp_path_factory.mktemp("gc") / "m", temperature=0.8, top_k=5,
                                    max_new_tokens=6)
    with_defaults, without = LLM(folder, **ENGINE), LLM(folder, generation_config="vllm", **ENGINE)
    yield with_defaults, without
    with_defaults.exit()
    without.exit()


def test_generate_without_sampling_params_samples_with_the_models_defaults(sampled_pair):
    with_defaults, without = sampled_pair
    assert with_defaults.get_default_sampling_params() == SamplingParams(temperature=0.8, top_k=5, max_tokens=6)
    assert without.get_default_sampling_params() == SamplingParams()
    got = [o.outputs[0].token_ids for o in with_defaults.generate(PROMPTS, use_tqdm=False)]
    # the same seeds in the same order: the other engine gives the same ids once it is told the same settings
    want = [o.outputs[0].token_ids for o in without.generate(
        PROMPTS, SamplingParams(temperature=0.8, top_k=5, max_tokens=6), use_tqdm=False)]
    assert got == want and max(map(len, got)) == 6


def test_a_given_sampling_params_is_never_changed(sampled_pair):
    with_defaults, without = sampled_pair
    sp = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in with_defaults.generate(PROMPTS, sp, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in without.generate(PROMPTS, sp, use_tqdm=False)]
    assert list(map(len, got)) == [9, 9]


def test_the_engine_warns_which_defaults_it_took_and_from_where(tmp_path, caplog):
    folder = with_generation_config(tmp_path / "m", temperature=0.6, max_new_tokens=7)
    with caplog.at_level("WARNING", logger="nanovllm_ref"):
        LLM(folder, override_generation_config={"top_k": 3}, **ENGINE).exit()
    (line,) = [r.getMessage() for r in caplog.records if "sampling defaults" in r.getMessage()]
    assert line.startswith("sampling defaults temperature=0.6, max_new_tokens=7, top_k=3 (from ")
    assert "generation_config.json and override_generation_config) apply where a request leaves" in line
    caplog.clear()
    with caplog.at_level("WARNING", logger="nanovllm_ref"):
        LLM(folder, generation_config="vllm", override_generation_config={"top_k": 3}, **ENGINE).exit()
    (line,) = [r.getMessage() for r in caplog.records if "sampling defaults" in r.getMessage()]
    assert "top_k=3 (from override_generation_config)" in line and "json" not in line
    caplog.clear()
    with caplog.at_level("WARNING", logger="nanovllm_ref"):
        LLM(folder, generation_config="vllm", **ENGINE).exit()
    assert not [r for r in caplog.records if "sampling defaults" in r.getMessage()]


def test_a_refusal_caused_by_a_default_says_it_came_from_the_generation_config(tmp_path):
    folder = with_generation_config(tmp_path / "m", max_new_tokens=1000)
    llm = LLM(folder, num_kvcache_blocks=3, **ENGINE)        # 48 token slots
    try:
        for call in (lambda: llm.generate([[5, 6, 7]], use_tqdm=False), lambda: llm.add_request([5, 6, 7])):
            with pytest.raises(ValueError, match=r"lower max_tokens .* \(max_tokens=1000 is the model's default, "
                                                 "from its generation config: pass SamplingParams"):
                call()
        with pytest.raises(ValueError) as err:
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1000), use_tqdm=False)
        assert "generation config" not in str(err.value)
        assert llm.is_finished()
    finally:
        llm.exit()


def test_add_request_and_chat_without_sampling_params_take_the_defaults_too(tmp_path):
    folder = with_generation_config(tmp_path / "m", temperature=0.9)
    llm = LLM(folder, override_generation_config={"temperature": 0, "max_new_tokens": 4}, **ENGINE)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=4)
        rid = llm.add_request(PROMPTS[0])
        done = {}
        while not llm.is_finished():
            done.update({o.request_id: o for o in llm.step() if o.finished})
        want = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)[0].outputs[0].token_ids
        assert done[rid].outputs[0].token_ids == want and len(want) <= 4
        conv = [{"role": "user", "content": "Hi"}]
        assert (llm.chat(conv, use_tqdm=False)[0].outputs[0].token_ids
                == llm.chat(conv, greedy, use_tqdm=False)[0].outputs[0].token_ids)
    finally:
        llm.exit()
