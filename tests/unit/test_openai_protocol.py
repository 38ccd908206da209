"""The OpenAI wire format alone: body parsing, field errors, the mapping to
``SamplingParams``, logprob shapes, and the serve configuration (no Ray, no HTTP)."""

from __future__ import annotations

import json

import pytest

from tessera.cluster.config import ConfigError, ServeConfig, load_config_file
from tessera.cluster.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    LogprobFormatter,
    parse_body,
    usage,
)
from tessera.workers.api import SamplingParams, TokenLogprob


def completion(**body) -> CompletionRequest:
    return parse_body(json.dumps(body).encode(), CompletionRequest)


def chat(**body) -> ChatCompletionRequest:
    return parse_body(json.dumps(body).encode(), ChatCompletionRequest)


def error_of(fn) -> APIError:
    with pytest.raises(APIError) as caught:
        fn()
    return caught.value


def test_prompt_forms():
    assert completion(prompt="hi").prompts() == ["hi"]
    assert completion(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert completion(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert completion(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    assert error_of(lambda: completion(prompt=[]).prompts()).param == "prompt"
    assert error_of(lambda: completion(prompt=[[1], []]).prompts()).param == "prompt"
    too_many = error_of(lambda: completion(prompt=["a"] * 65).prompts())
    assert too_many.message == "prompt: at most 64 prompts, got 65"


def test_sampling_fields_map_to_the_engine():
    body = completion(
        prompt="x",
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        n=2,
        seed=11,
        stop="END",
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.1,
        logprobs=3,
        ignore_eos=True,
        min_tokens=2,
        stop_token_ids=[7],
    )
    assert body.sampling_for(20) == SamplingParams(
        max_tokens=20,
        min_tokens=2,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        n=2,
        seed=11,
        stop=("END",),
        stop_token_ids=(7,),
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.1,
        logprobs=3,
        ignore_eos=True,
    )


def test_beam_search_extras():
    sampling = completion(prompt="x", use_beam_search=True, n=2, length_penalty=0.5).sampling_for(8)
    assert (sampling.beam_width, sampling.n, sampling.length_penalty) == (2, 2, 0.5)
    assert completion(prompt="x", beam_width=4, n=2).sampling_for(8).beam_width == 4
    refused = error_of(
        lambda: completion(prompt="x", use_beam_search=True, beam_width=1).sampling_for(8)
    )
    assert refused.param == "beam_width"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"prompt": "x", "foo": 1}, "foo", "Unrecognized request argument supplied: foo"),
        ({"prompt": "x", "n": "2"}, "n", "n: Input should be a valid integer, got '2'"),
        ({"prompt": "x", "stream": 1}, "stream", "stream: Input should be a valid boolean"),
        ({"prompt": "x", "temperature": 101}, "temperature", "between 0 and 100"),
        ({"prompt": "x", "stop": ["a"] * 17}, "stop", "at most 16 stop strings, got 17"),
        ({"prompt": "x", "timeout": 0}, "timeout", "timeout: must be a number of seconds > 0"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ({"prompt": "x", "suffix": "y"}, "suffix", "suffix: must be null: this server has no"),
        ({}, "prompt", "prompt: is required"),
        (
            {"prompt": "x", "speculative": {"method": "eagle"}},
            "speculative.method",
            "must be one of ngram, draft, got 'eagle'",
        ),
        (
            {"prompt": "x", "speculative": {"num_tokens": 99}},
            "speculative.num_tokens",
            "must be in [0, 16], got 99",
        ),
        (
            {"prompt": "x", "speculative": {"method": "ngram", "k": 2}},
            "speculative.k",
            "Unrecognized request argument supplied: speculative.k",
        ),
        (
            {"prompt": "x", "parallel_tokens": {"threshold": 1.5}},
            "parallel_tokens.threshold",
            "must be in (0, 1], got 1.5",
        ),
        (
            {"prompt": "x", "n": 2, "parallel_tokens": {}},
            "parallel_tokens",
            "is not supported with n > 1",
        ),
    ],
)
def test_completion_errors_name_the_field(body, param, message):
    def build():
        completion(**body).sampling_for(4)

    error = error_of(build)
    assert (error.status, error.param) == (400, param)
    assert message in error.message
    assert error.body() == {
        "error": {
            "message": error.message,
            "type": "invalid_request_error",
            "param": param,
            "code": "invalid_value",
        }
    }


def test_speculative_and_parallel_tokens_map_to_the_engine():
    from tessera.workers.api import ParallelTokensParams, SpeculativeParams

    spec = completion(prompt="x", speculative={"method": "draft", "num_tokens": 2})
    assert spec.sampling_for(4).speculative == SpeculativeParams("draft", 2, True)
    assert completion(prompt="x").sampling_for(4).speculative is None
    body = {"threshold": 0.2, "max_width": 3, "mode": "visible"}
    parallel = chat(messages=[{"role": "user", "content": "hi"}], parallel_tokens=body)
    assert parallel.sampling_for(4).parallel_tokens == ParallelTokensParams(0.2, 3, "visible")


def test_malformed_bodies():
    assert "not valid JSON" in error_of(lambda: parse_body(b"{", CompletionRequest)).message
    not_object = error_of(lambda: parse_body(b'"text"', CompletionRequest))
    assert not_object.message == "the body must be a JSON object, got str"
    assert error_of(lambda: parse_body(b"\xff", CompletionRequest)).status == 400


def test_chat_messages_and_logprobs():
    body = chat(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
            },
        ],
        logprobs=True,
        top_logprobs=4,
        max_completion_tokens=9,
        max_tokens=3,
    )
    assert body.conversation() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    assert body.requested_max_tokens == 9  # max_completion_tokens wins
    assert body.sampling_for(9).logprobs == 4
    assert (
        chat(messages=[{"role": "user", "content": "x"}], logprobs=True).sampling_for(2).logprobs
        == 0
    )
    assert chat(messages=[{"role": "user", "content": "x"}]).sampling_for(2).logprobs is None
    role = error_of(lambda: chat(messages=[{"role": "robot", "content": "x"}]))
    assert role.param == "messages.0.role"
    image = error_of(
        lambda: chat(messages=[{"role": "user", "content": [{"type": "image_url", "url": "x"}]}])
    )
    assert image.param == "messages.0.content"
    assert str(image) == (
        "messages.0.content: must be a string or a list of text parts ({'type': 'text', "
        "'text': ...}): the model reads text only, got [{'type': 'image_url', 'url': 'x'}]"
    )


def test_chat_takes_openai_bookkeeping_fields_that_change_no_token():
    message = [{"role": "user", "content": "x"}]
    plain = chat(messages=message).sampling_for(4)
    kept = chat(
        messages=message,
        metadata={"team": "a"},
        service_tier="auto",
        prompt_cache_key="k",
        safety_identifier="s",
        store=False,
    )
    assert kept.sampling_for(4) == plain
    store = error_of(lambda: chat(messages=message, store=True))
    assert str(store) == (
        "store: must be false: this server keeps no completions to fetch later, got True"
    )
    tier = error_of(lambda: chat(messages=message, service_tier="turbo"))
    assert tier.param == "service_tier" and "got 'turbo'" in str(tier)


class _Tokenizer:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def test_logprob_shapes():
    entries = [TokenLogprob(5, -0.1, ((5, -0.1), (6, -2.0))), TokenLogprob(7, -1.0, ())]
    formatter = LogprobFormatter(_Tokenizer())
    out, offset = formatter.completion(entries, offset=3)
    assert out == {
        "tokens": ["<5>", "<7>"],
        "token_logprobs": [-0.1, -1.0],
        "top_logprobs": [{"<5>": -0.1, "<6>": -2.0}, {"<7>": -1.0}],
        "text_offset": [3, 6],
    }
    assert offset == 9
    content = formatter.chat(entries)
    assert content[0] == {
        "token": "<5>",
        "logprob": -0.1,
        "bytes": list(b"<5>"),
        "top_logprobs": [
            {"token": "<5>", "logprob": -0.1, "bytes": list(b"<5>")},
            {"token": "<6>", "logprob": -2.0, "bytes": list(b"<6>")},
        ],
    }
    assert usage(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_serve_config(tmp_path):
    config = ServeConfig.create(max_request_bytes="1MiB", kv_cache_memory="512MiB", workers=2)
    assert (config.max_request_bytes, config.kv_cache_memory) == (2**20, 512 * 2**20)
    assert config.cluster_config().workers == 2
    assert config.model_name == "SmolLM2-135M-Instruct"
    assert ServeConfig.create(served_model_name="m").model_name == "m"
    with pytest.raises(ConfigError, match="min_replicas: 3 is above max_replicas"):
        ServeConfig.create(min_replicas=3, max_replicas=2)
    path = tmp_path / "c.yaml"
    path.write_text("workers: 2\nport: 9000\n")
    assert load_config_file(str(path)) == {"workers": 2, "port": 9000}
    path.write_text("wrokers: 2\n")
    with pytest.raises(ConfigError, match="wrokers: not a setting"):
        load_config_file(str(path))
    with pytest.raises(ConfigError, match="config: cannot read"):
        load_config_file(str(tmp_path / "missing.yaml"))


def test_api_key_comes_from_the_environment_unless_given(monkeypatch):
    monkeypatch.setenv("TESSERA_API_KEY", "from-env")
    assert ServeConfig.create().api_key.get_secret_value() == "from-env"
    assert ServeConfig.create(api_key="given").api_key.get_secret_value() == "given"
    monkeypatch.delenv("TESSERA_API_KEY")
    assert ServeConfig.create().api_key is None


def test_null_fields_take_their_defaults():
    body = completion(prompt="x", temperature=None, n=None, stop=None, seed=None)
    assert body.sampling_for(4) == SamplingParams(max_tokens=4)
    assert chat(messages=[{"role": "user", "content": "x"}], logprobs=None).logprobs is False
