"""Issue 23's bad input: each refused with a ValueError / TypeError naming the argument, before any state
changes and, where possible, before the weights load; and the engine's random stream kept apart from the
user's."""
import json
import os
from types import SimpleNamespace

import pytest
import torch

from engine_helpers import LLM, hf_greedy, tiny_dir
from nanovllm_ref import SamplingParams
from nanovllm_ref.engine.request import check_request
from nanovllm_ref.engine.scheduler import Scheduler
from nanovllm_ref.sampling_params import PENDING, TOP_K_MAX
from nanovllm_models.tiny import make_tiny_model

P = [5, 6, 7, 8]
G = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def weightless(tmp_path, **overrides):
    """A model folder without weights: an error about anything else proves the check ran before loading."""
    path = make_tiny_model(str(tmp_path / "m"), "qwen3", **overrides)
    os.remove(os.path.join(path, "model.safetensors"))
    return path


def cli(argv, capsys):
    from nanovllm_ref.__main__ import main
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


# -- vocabulary -------------------------------------------------------------------------------------------------
def test_tokenizer_larger_than_the_embedding_table_is_refused_before_the_weights_load(tmp_path):
    path = weightless(tmp_path, vocab_size=300)          # the tiny tokenizer has 384 tokens
    with pytest.raises(ValueError, match=r"384 tokens.*300 rows \(config.json vocab_size\)"):
        LLM(path)


def test_str_prompt_ids_are_checked_against_the_vocabulary():
    # The start-up check makes this unreachable through LLM; check_request still refuses it by name.
    llm = LLM(tiny_dir("qwen3"), kvcache_block_size=4, max_model_len=64)
    word = next(w for w in ("prefix", "caching", "Continuous", "Tensor") if max(llm.tokenizer.encode(w)) >= 300)
    config = SimpleNamespace(hf_config=SimpleNamespace(vocab_size=300), max_model_len=64, max_num_seqs=8,
                             kvcache_block_size=4, num_kvcache_blocks=-1)
    with pytest.raises(ValueError, match=r"prompt has token ids outside \[0, 300\).*the tokenizer made them"):
        check_request(word, G, tokenizer=llm.tokenizer, config=config, scheduler_cls=Scheduler)


# -- text that cannot be tokenized (a lone surrogate: half of a UTF-16 pair, from JSON's \ud800 escape) -----------
def test_a_prompt_that_cannot_be_tokenized_is_a_value_error_naming_it_before_any_work():
    llm = LLM(tiny_dir("qwen3"), kvcache_block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"^prompts\[1\] is not valid text: character 2 is a lone surrogate"):
        llm.generate(["fine", "ab\ud800"], G, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompt is not valid text: character 0"):
        llm.add_request("\udfff", G)
    with pytest.raises(ValueError, match=r"messages\[0\]\[1\]\.content is not valid text"):
        llm.chat([{"role": "system", "content": "ok"}, {"role": "user", "content": "x\udc80"}], G, use_tqdm=False)
    with pytest.raises(ValueError, match=r"chat_template_kwargs\.persona is not valid text"):
        llm.chat([{"role": "user", "content": "hi"}], G, use_tqdm=False, chat_template_kwargs={"persona": "\ud800"})
    assert llm.is_finished() and not llm.requests
    assert llm.generate(["fine"], G, use_tqdm=False)[0].finished


def test_cli_prompt_that_is_not_utf8_is_named_before_the_weights_load(tmp_path, capsys):
    # argv bytes that are not UTF-8 reach Python as lone surrogates (surrogateescape)
    for flags in ([], ["--chat"]):
        code, _, err = cli(["generate", "--model", weightless(tmp_path / str(len(flags))), "--prompt", "ok",
                            "--prompt", "a\udcffb", "--device", "cpu", *flags], capsys)
        assert code == 2 and "prompt 2" in err and "is not valid text" in err and "safetensors" not in err, err


# -- sampling settings ----------------------------------------------------------------------------------------
def test_huge_top_k_keeps_every_token_and_never_fails_mid_run():
    sp = SamplingParams(temperature=1.0, max_tokens=6, top_k=10**30, ignore_eos=True)
    assert sp.top_k == TOP_K_MAX
    path = tiny_dir("qwen3")
    huge = LLM(path, kvcache_block_size=4, max_model_len=64, seed=7).generate([P, [9, 10]], sp, use_tqdm=False)
    # k = the vocabulary keeps everything too, and runs the same (filtered) sampler path, so the same draws
    every = LLM(path, kvcache_block_size=4, max_model_len=64, seed=7).generate(
        [P, [9, 10]], SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, top_k=512), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in huge] == [o.outputs[0].token_ids for o in every]


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(n=0), ValueError, "n must be >= 1"),
    (dict(n=1.5), TypeError, "n must be an int"),
    (dict(stop=[""]), ValueError, "empty string"),
    (dict(stop=5), TypeError, "stop must be a str or a list of str"),
    (dict(stop=["a", 3]), TypeError, "stop must be"),
    (dict(stop_token_ids=[-1]), ValueError, r"stop_token_ids\[0\] must be >= 0"),
    (dict(stop_token_ids="3"), TypeError, "stop_token_ids must be a list"),
    (dict(stop_token_ids=[True]), TypeError, r"stop_token_ids\[0\] must be an int"),
    (dict(min_tokens=9, max_tokens=8), ValueError, r"min_tokens must be in \[0, 8\]"),
    (dict(min_tokens=-1), ValueError, "min_tokens"),
    (dict(include_stop_str_in_output="yes"), TypeError, "include_stop_str_in_output must be a bool"),
    (dict(skip_special_tokens=1), TypeError, "skip_special_tokens must be a bool"),
    (dict(seed=2**64), ValueError, "seed"),
    (dict(seed="1"), TypeError, "seed must be an int"),
    (dict(logprobs=-1), ValueError, "logprobs"),
    (dict(prompt_logprobs=1.0), TypeError, "prompt_logprobs"),
    (dict(presence_penalty=2.5), ValueError, r"presence_penalty must be a finite number in \[-2, 2\]"),
    (dict(frequency_penalty=float("nan")), ValueError, "frequency_penalty"),
    (dict(repetition_penalty=0), ValueError, "repetition_penalty must be a finite number > 0"),
    (dict(min_p=1.5), ValueError, r"min_p must be a finite number in \[0, 1\]"),
    (dict(top_k=-2), ValueError, "top_k"),
    # finite in Python, not in the sampler's fp32 (a reported fault: 1e300 became inf, and min_tokens' masked
    # logits then NaN, so every token was id 0), or out of the rule once rounded to fp32
    (dict(temperature=1e300), ValueError, "temperature must be a finite number >= 0 .* in fp32's range"),
    (dict(temperature=3.5e38), ValueError, "temperature .* fp32"),
    (dict(repetition_penalty=1e308), ValueError, "repetition_penalty .* fp32"),
    (dict(repetition_penalty=1e-300), ValueError, r"repetition_penalty must be a finite number > 0 .* fp32"),
    # an int no float holds (a reported fault: math.isfinite raised a bare OverflowError); the number is cut short
    (dict(temperature=10**400), ValueError, r"temperature must be a finite number >= 0 .*got 10{19}\.\.\. \(401 characters\)$"),
    (dict(top_p=-10**400), ValueError, r"top_p must be a finite number in \(0, 1\]"),
    (dict(presence_penalty=10**309), ValueError, "presence_penalty must be a finite number"),
])
def test_new_sampling_fields_are_checked_by_name(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SamplingParams(**kwargs)


def test_top_p_is_read_as_the_python_float_so_a_tiny_one_is_taken():
    """top_p reaches the sampler as the request's float (not fp32): 1e-50 keeps the top token only."""
    assert SamplingParams(top_p=1e-50).top_p == 1e-50


def test_the_largest_fp32_temperature_samples_flat_with_min_tokens():
    """3.4e38 fits fp32, so it is taken: logits / T are all about 0, the draw is flat, exactly as at 1e30 with
    the same seed, and min_tokens' masked tokens stay masked (no NaN rows, no id 0 run)."""
    llm = LLM(tiny_dir("qwen3"), kvcache_block_size=4, max_model_len=64)
    for seed in range(3):
        got = [llm.generate([[5, 6, 7]], SamplingParams(temperature=t, max_tokens=6, min_tokens=4, seed=seed,
                                                          stop_token_ids=[5]), use_tqdm=False)[0].outputs[0].token_ids
               for t in (3.4e38, 1e30)]
        assert got[0] == got[1], (seed, got)
        assert not {5, llm.tokenizer.eos_token_id} & set(got[0][:4]) and got[0][:4] != [0] * 4
    llm.exit()


def test_fields_past_the_first_five_are_keyword_only_and_normalised():
    with pytest.raises(TypeError):
        SamplingParams(0, 8, False, 0, 1.0, 2)
    sp = SamplingParams(stop="x", stop_token_ids=[3])
    assert sp.stop == ("x",) and sp.stop_token_ids == (3,) and SamplingParams().stop == ()


def test_every_sampling_field_is_implemented():
    assert PENDING == {}


@pytest.mark.parametrize("name", ["min_p", "logprobs"])
def test_fields_without_a_sampler_yet_are_refused_by_name_before_queuing(name, monkeypatch):
    """The refusal of a field accepted before its engine side exists (PENDING; empty now, so one is faked)."""
    monkeypatch.setitem(PENDING, name, getattr(SamplingParams(), name))
    value = {"logprobs": 2, "min_p": 0.1}[name]
    llm = LLM(tiny_dir("qwen3"), kvcache_block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=rf"sampling_params\[1\]: SamplingParams.{name}=.* not implemented yet"):
        llm.generate([P, P], [G, SamplingParams(**{name: value})], use_tqdm=False)
    with pytest.raises(ValueError, match=name):
        llm.add_request(P, SamplingParams(**{name: value}))
    assert llm.is_finished() and not llm.requests
    assert llm.generate([P], G, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(tiny_dir("qwen3"), P, 4)


class OwnPostprocess(Scheduler):
    """A scheduler part with its own postprocess (chapter 07's exercise): eos and max_tokens only."""

    def postprocess(self, seqs, token_ids):
        return Scheduler.postprocess(self, seqs, token_ids)


@pytest.mark.parametrize("field,value", [("stop", ["a"]), ("stop_token_ids", [5]), ("min_tokens", 2), ("n", 2)])
def test_features_of_the_reference_postprocess_are_refused_with_a_scheduler_part(field, value):
    from nanovllm_ref import Parts
    llm = LLM(tiny_dir("qwen3"), parts=Parts(scheduler=OwnPostprocess), kvcache_block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=rf"SamplingParams.{field} needs the reference Scheduler.postprocess"):
        llm.generate([P], SamplingParams(max_tokens=4, **{field: value}), use_tqdm=False)
    assert llm.generate([P], G, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(tiny_dir("qwen3"), P, 4)


# -- the engine's random stream ---------------------------------------------------------------------------------
def _draws():
    """The user's next draws from torch's default generators (CPU, and the GPU's when there is one)."""
    return [torch.rand(4)] + ([torch.rand(4, device="cuda").cpu()] if torch.cuda.is_available() else [])


def test_engine_leaves_the_users_random_stream_alone():
    torch.manual_seed(123)                                # seeds the CUDA generators too
    want = _draws()
    torch.manual_seed(123)
    llm = LLM(tiny_dir("qwen3"), kvcache_block_size=4, max_model_len=64, seed=0)
    llm.generate([P], SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    got = _draws()
    assert all(torch.equal(g, w) for g, w in zip(got, want)), "creating an engine or sampling moved the user's stream"


def test_users_draws_between_steps_do_not_change_the_samples():
    sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    path = tiny_dir("qwen3")
    quiet = LLM(path, kvcache_block_size=4, max_model_len=64, seed=5).generate([P, [9, 10]], sp, use_tqdm=False)
    llm = LLM(path, kvcache_block_size=4, max_model_len=64, seed=5)
    ids = [llm.add_request(p, sp) for p in (P, [9, 10])]
    done = {}
    while not llm.is_finished():
        _draws()                                          # the user's own draws
        done.update((o.request_id, o.outputs[0].token_ids) for o in llm.step() if o.finished)
    assert [done[i] for i in ids] == [o.outputs[0].token_ids for o in quiet]


# -- the command line ---------------------------------------------------------------------------------------------
def test_cli_folder_without_a_tokenizer_says_so(tmp_path, capsys):
    path = make_tiny_model(str(tmp_path / "m"), "qwen3", tokenizer=False)
    code, _, err = cli(["generate", "--model", path, "--prompt", "Hello", "--device", "cpu"], capsys)
    assert code == 2 and "no usable tokenizer" in err and "empty" not in err


def test_cli_ctrl_c_prints_one_line_and_exits_130(monkeypatch, capsys):
    from nanovllm_ref.llm import LLM as EngineLLM

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(EngineLLM, "generate", interrupted)
    code, _, err = cli(["generate", "--model", tiny_dir("qwen3"), "--prompt", "Hi", "--device", "cpu"], capsys)
    assert code == 130 and err.strip() == "interrupted"


def test_cli_transformers_config_error_is_one_line(tmp_path, capsys):
    path = weightless(tmp_path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_attention_heads"] = "four"                   # transformers' strict config validation
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    code, _, err = cli(["generate", "--model", path, "--prompt", "Hi", "--device", "cpu"], capsys)
    assert code == 2 and err.startswith("error: ") and "config.json is not a valid" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(path)


def test_cli_broken_chat_template_is_one_line(tmp_path, capsys):
    path = weightless(tmp_path)
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        tc = json.load(f)
    tc["chat_template"] = "{% for m in messages %}{{ m.content }"
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f)
    for name in ("chat_template.jinja",):
        if os.path.exists(os.path.join(path, name)):
            with open(os.path.join(path, name), "w") as f:
                f.write(tc["chat_template"])
    code, _, err = cli(["generate", "--model", path, "--prompt", "Hi", "--chat", "--device", "cpu"], capsys)
    assert code == 2 and "chat_template does not compile" in err and "Traceback" not in err


@pytest.mark.parametrize("flags,message", [
    (["--top-k", "-5"], "top_k"),
    (["--n", "0"], "n must be"),
    (["--min-tokens", "9", "--max-tokens", "4"], "min_tokens"),
    (["--stop-token-id", "100000"], "stop_token_ids"),
    (["--stop", ""], "empty string"),
])
def test_cli_checks_the_new_sampling_flags_before_loading_weights(tmp_path, capsys, flags, message):
    code, _, err = cli(["generate", "--model", weightless(tmp_path), "--prompt", "Hi", "--device", "cpu", *flags],
                       capsys)
    assert code == 2 and message in err and "safetensors" not in err


def test_cli_new_flags_reach_the_engine(capsys):
    code, out, _ = cli(["generate", "--model", tiny_dir("qwen3"), "--prompt", "Hello", "--device", "cpu",
                        "--max-tokens", "3", "--n", "2", "--top-k", str(10**30), "--temperature", "1"], capsys)
    assert code == 0 and "[sample 1 of 2]" in out and "[sample 2 of 2]" in out and "6 output tokens" in out


def test_nearby_and_sign_flipped_seeds_give_different_samples():
    """Seeds 0 and -1, 1 and 2**32, 2**63 - 1 and 2**63 went to one random stream (the two 32-bit halves were
    xor-folded); seeds equal mod 2**64 (-2**63 and 2**63) stay one stream, as in torch.manual_seed."""
    from nanovllm_ref.engine.sequence import request_seed
    pairs = [(0, -1), (1, 2**32), (0, 2**32 + 1), (2**63 - 1, 2**63)]
    for a, b in pairs:
        assert request_seed(a) != request_seed(b), (a, b)
    assert request_seed(-2**63) == request_seed(2**63) and request_seed(5, 0) != request_seed(5, 1)
    llm = LLM(tiny_dir("qwen3"), max_model_len=64)
    draws = {s: llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, seed=s, max_tokens=8), use_tqdm=False)[0]
             .outputs[0].token_ids for s in (0, -1, 1, 2**32, 2**32 + 1)}
    assert len({tuple(v) for v in draws.values()}) == 5, draws
    again = llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, seed=-1, max_tokens=8), use_tqdm=False)
    assert again[0].outputs[0].token_ids == draws[-1]


def test_numpy_bool_is_taken_as_a_bool():
    import numpy as np
    assert SamplingParams(include_stop_str_in_output=np.bool_(True)).include_stop_str_in_output is True
    with pytest.raises(TypeError, match=r"ignore_eos must be a bool, got numpy\.int64"):
        SamplingParams(ignore_eos=np.int64(1))
