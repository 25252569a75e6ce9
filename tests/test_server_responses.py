"""`server/responses.py`: the OpenAI objects built from the scheduler's outputs, without a model or
HTTP (the server tests check the same objects end to end)."""

import json

import pytest

from specdec.errors import Fault
from specdec.request import Completion, Delta, Usage
from specdec.server import responses as R
from specdec.step import TokenLogprob


class Letters:
    """A tokenizer whose token i spells the i-th of its pieces."""

    def __init__(self, *pieces: str):
        self.pieces = pieces

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)


@pytest.mark.fast
def test_completion_logprobs_spell_tokens_and_count_offsets_from_where_the_text_starts():
    tok = Letters("a", "bc", "déf")
    items = [TokenLogprob(1, -0.5, [(1, -0.5), (0, -1.0)]), TokenLogprob(2, -0.25, [(2, -0.25)])]
    got = R.completion_logprobs(items, tok, offset=3)
    assert got == {"tokens": ["bc", "déf"], "token_logprobs": [-0.5, -0.25],
                   "top_logprobs": [{"bc": -0.5, "a": -1.0}, {"déf": -0.25}], "text_offset": [3, 5]}
    assert R.completion_logprobs(None, tok, 0) is None


@pytest.mark.fast
def test_chat_logprobs_carry_utf8_bytes_and_no_tokenizer_spells_nothing():
    items = [TokenLogprob(2, -0.1, [(2, -0.1), (0, -2.0)])]
    got = R.chat_logprobs(items, Letters("a", "b", "é"))
    assert got == {"content": [{"token": "é", "logprob": -0.1, "bytes": [195, 169], "top_logprobs": [
        {"token": "é", "logprob": -0.1, "bytes": [195, 169]}, {"token": "a", "logprob": -2.0, "bytes": [97]}]}]}
    assert R.chat_logprobs(items, None)["content"][0]["token"] == ""


@pytest.mark.fast
def test_usage_counts_totals_cache_hits_and_prediction_tokens_only_with_a_prediction():
    plain = R.usage_dict(Usage(7, 3, cached_tokens=4))
    assert plain == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                     "prompt_tokens_details": {"cached_tokens": 4}}
    predicted = R.usage_dict(Usage(7, 4, predicted=([1, 2, 3, 9], [1, 2, 3, 4])))
    assert predicted["completion_tokens_details"] == {"accepted_prediction_tokens": 3,
                                                      "rejected_prediction_tokens": 1}


@pytest.mark.fast
def test_chunks_send_usage_null_only_when_usage_is_asked_for():
    base = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    delta = Delta("hi", [0], finish_reason="stop")
    assert "usage" not in R.completion_chunk(base, delta, None, 0, include_usage=False)
    chunk = R.completion_chunk(base, delta, None, 0, include_usage=True)
    assert chunk["usage"] is None and chunk["choices"] == [{"index": 0, "text": "hi", "logprobs": None,
                                                            "finish_reason": "stop"}]
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk"}
    assert R.chat_chunk(head, {"content": "x"}, include_usage=True)["usage"] is None
    assert "usage" not in R.chat_chunk(head, {"content": "x"})
    assert R.usage_chunk(head, {"total_tokens": 2}) == {**head, "choices": [], "usage": {"total_tokens": 2}}


@pytest.mark.fast
def test_whole_answers_and_the_stream_framing():
    result = Completion("ok", [1], None, "length", Usage(2, 1), None, None)
    body = R.completion({"id": "c"}, result, None, {"total_tokens": 3})
    assert body == {"id": "c", "choices": [{"index": 0, "text": "ok", "logprobs": None, "finish_reason": "length"}],
                    "usage": {"total_tokens": 3}}
    chat = R.chat_completion({"id": "d"}, {"role": "assistant", "content": "ok"}, "stop", None, {})
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"] == "ok"
    assert R.sse({"t": "é"}) == 'data: {"t": "é"}\n\n' and R.SSE_DONE == "data: [DONE]\n\n"
    fault = R.fault_body(Fault(400, "invalid_request_error", "bad grammar", "response_format"))
    assert fault == {"error": {"message": "bad grammar", "type": "invalid_request_error",
                               "param": "response_format", "code": None}}
    assert json.loads(json.dumps(R.model_list("tiny", 5, 512)))["data"][0] == {
        "id": "tiny", "object": "model", "created": 5, "owned_by": "specdec", "max_model_len": 512}
