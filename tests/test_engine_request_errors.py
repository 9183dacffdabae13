"""Every refusal of a request carries the argument at fault: SamplingParams' checks and check_request
(engine/request.py) raise RequestError (nanovllm_ref/errors.py), a ValueError whose `field` is "prompt" or the
SamplingParams field, so a caller (the HTTP server) names its own field without reading the message."""
import pickle
from types import SimpleNamespace

import pytest

from nanovllm_ref import SamplingParams
from nanovllm_ref.engine.request import check_request, encode_text
from nanovllm_ref.engine.scheduler import Scheduler
from nanovllm_ref.errors import RequestError, RequestTypeError

CONFIG = dict(hf_config=SimpleNamespace(vocab_size=100), max_num_seqs=4, max_model_len=64, kvcache_block_size=4,
              num_kvcache_blocks=8)


class _OwnPostprocess(Scheduler):
    def postprocess(self, seqs, token_ids):
        pass


SAMPLING = [   # (SamplingParams kwargs, field, type)
    ({"temperature": -1}, "temperature", RequestError), ({"temperature": "hot"}, "temperature", RequestTypeError),
    ({"top_k": -2}, "top_k", RequestError), ({"top_k": 2.5}, "top_k", RequestTypeError),
    ({"top_p": 0}, "top_p", RequestError), ({"min_p": 2}, "min_p", RequestError), ({"n": 0}, "n", RequestError),
    ({"max_tokens": 0}, "max_tokens", RequestError), ({"min_tokens": 70}, "min_tokens", RequestError),
    ({"stop": [""]}, "stop", RequestError), ({"stop": 5}, "stop", RequestTypeError),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids", RequestError),
    ({"stop_token_ids": 7}, "stop_token_ids", RequestTypeError), ({"ignore_eos": 1}, "ignore_eos", RequestTypeError),
    ({"seed": 2**64}, "seed", RequestError), ({"logprobs": -1}, "logprobs", RequestError),
    ({"presence_penalty": 3}, "presence_penalty", RequestError),
    ({"repetition_penalty": 0}, "repetition_penalty", RequestError),
]


@pytest.mark.parametrize("kwargs,field,kind", SAMPLING, ids=[f"{f}-{k.__name__}" for _, f, k in SAMPLING])
def test_sampling_params_errors_carry_their_field(kwargs, field, kind):
    with pytest.raises(kind) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field and str(info.value) == info.value.message
    assert str(info.value).startswith(field), "the message still names the field for a reader"


CHECKS = [   # (prompt, SamplingParams kwargs, config changes, scheduler, field, words of the message)
    ([1, 2], {"n": 5}, {}, Scheduler, "n", "max_num_seqs=4"),
    ([1, 2], {"stop_token_ids": [100]}, {}, Scheduler, "stop_token_ids", "outside the vocabulary"),
    ([1, 2], {"logprobs": 21}, {}, Scheduler, "logprobs", "more than 20"),
    ([1, 2], {"prompt_logprobs": 21}, {}, Scheduler, "prompt_logprobs", "more than 20"),
    ([1, 2], {"stop": ["x"]}, {}, _OwnPostprocess, "stop", "needs the reference Scheduler.postprocess"),
    ([1, 100], {}, {}, Scheduler, "prompt", "outside [0, 100)"),
    ([], {}, {}, Scheduler, "prompt", "is empty"),
    ([1] * 65, {}, {}, Scheduler, "prompt", "more than max_model_len=64"),
    ([1] * 33, {"max_tokens": 1}, {}, Scheduler, "prompt", "its 33 tokens need 9 blocks of 4"),
    ([1] * 20, {"max_tokens": 14}, {}, Scheduler, "max_tokens", "at most 13"),
    ([1, "x"], {}, {}, Scheduler, "prompt", "prompt[1] must be an int"),
    ([1, True, 3], {}, {}, Scheduler, "prompt", "prompt[1] must be an int token id, got bool"),
    ([-1, 5, 100, 101, 3], {}, {}, Scheduler, "prompt", "outside [0, 100): [-1, 100, 101]"),
    (b"ab", {}, {}, Scheduler, "prompt", "must be a str or a list"),
]


@pytest.mark.parametrize("prompt,kwargs,config,scheduler,field,says", CHECKS,
                         ids=[f"{c[4]}-{i}" for i, c in enumerate(CHECKS)])
def test_check_request_refusals_carry_their_field(prompt, kwargs, config, scheduler, field, says):
    with pytest.raises(RequestError) as info:
        check_request(prompt, SamplingParams(**{"max_tokens": 4, **kwargs}), tokenizer=None,
                      config=SimpleNamespace(**{**CONFIG, **config}), scheduler_cls=scheduler)
    assert info.value.field == field and says in info.value.message, info.value.message


def test_plain_and_numpy_int_prompts_give_the_same_ids():
    """Plain ints take check_request's fast path (one type check for the list, min/max for the range); other
    integers (numpy's) the per-id path: the same list of Python ints either way."""
    import numpy as np
    config, sp = SimpleNamespace(**CONFIG), SamplingParams(max_tokens=4)
    ids = [0, 7, 99, 42]
    plain = check_request(ids, sp, tokenizer=None, config=config, scheduler_cls=Scheduler)
    numpy_ids = check_request(list(np.array(ids, dtype=np.int64)), sp, tokenizer=None, config=config,
                              scheduler_cls=Scheduler)
    assert plain == numpy_ids == ids and all(type(t) is int for t in numpy_ids) and plain is not ids


def test_the_kv_cache_edge_is_exact():
    """8 blocks of 4 hold 32 tokens: a prompt of 20 may ask for 13 (20 + 13 - 1 = 32 tokens of K/V), not 14."""
    config = SimpleNamespace(**CONFIG)
    assert check_request([1] * 20, SamplingParams(max_tokens=13), tokenizer=None, config=config,
                         scheduler_cls=Scheduler) == [1] * 20
    assert check_request([1] * 32, SamplingParams(max_tokens=1), tokenizer=None, config=config,
                         scheduler_cls=Scheduler) == [1] * 32


def test_text_that_cannot_be_encoded_is_a_prompt_error():
    with pytest.raises(RequestError) as info:
        encode_text(None, "a\ud800", "prompts[2]")
    assert info.value.field == "prompt" and info.value.message.startswith("prompts[2] is not valid text")


def test_request_errors_are_value_and_type_errors_and_pickle_whole():
    err = RequestTypeError("top_k", "top_k must be an int")
    assert isinstance(err, TypeError) and isinstance(err, ValueError) and isinstance(err, RequestError)
    for e in (err, RequestError(field="prompt", message="prompt is empty")):
        back = pickle.loads(pickle.dumps(e))
        assert (type(back), back.field, back.message, str(back)) == (type(e), e.field, e.message, str(e))
