"""Tool calling in the model's own format (specdec.tools): the family chosen from the chat
template, the parsers on what each family's real template renders (Qwen2.5's hermes calls, Qwen3's
think blocks, Qwen2.5-Coder's fenced JSON, Llama 3.1's JSON and <|python_tag|>), constrained calls
valid for many seeds, greedy output identical with speculation on and off for every drafter
(required, named and the lazy "auto" constraint), the lazy masks against a fresh grammar, and a
two-sample chi-square test of sampled calls with a drafter against plain constrained sampling; the
call scanner pushed in every split assembling into the whole answer (tool_scan), strict mode's
schema rules, the per-pattern compile probe, and forced-token drafts (greedy identity with and
without them). On tiny random models carrying the real Qwen2.5 and Llama 3.1 templates
(tests/templates)."""

import json

import pytest
import torch

from specdec import Engine, SamplingParams
from specdec import tool_scan as S
from specdec import tools as T
from specdec.drafters import DraftModelDrafter, NgramDrafter, SuffixDrafter
from specdec.drafters.base import DrafterBase, Proposal
from specdec.errors import InvalidRequestError

from tool_models import make_tool_model

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from test_penalties import Oracle

pytestmark = pytest.mark.usefixtures("one_thread")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "integer", "minimum": -12,
                                                                              "maximum": 14}},
                                       "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["qwen", "llama"])
def family(request, tmp_path_factory):
    folder, ids = make_tool_model(tmp_path_factory.mktemp("tools"), request.param)
    return request.param, folder, ids, Engine.load(str(folder), dtype="float32")


def render(engine, toolset, messages=ASK):
    return engine.tokenizer.encode_chat(messages, tools=toolset.template_tools())


def assert_valid(calls, names=SCHEMAS):
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), names[call.name])


def test_family_is_chosen_from_the_template(family):
    name, _, _, engine = family
    assert T.family_of(engine.tokenizer.chat_template) is (T.HERMES if name == "qwen" else T.LLAMA3)
    with pytest.raises(InvalidRequestError) as info:
        T.family_of("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert info.value.param == "tools"


def test_parsers_read_calls_as_the_real_template_renders_them(family):
    """An assistant turn with a call, rendered by the family's own template, parses back to it."""
    name, _, ids, engine = family
    tok = engine.tokenizer
    toolset = T.tool_set(TOOLS, "auto")
    fam = T.family_of(tok.chat_template)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "c"}'}}
    msgs = T.history(ASK + [{"role": "assistant", "content": ""}], [None, [call]])
    bare = tok.encode_chat(ASK, tools=toolset.template_tools())
    whole = tok.encode_chat(msgs, add_generation_prompt=False, tools=toolset.template_tools())
    assert whole[: len(bare)] == bare  # the generation prompt, then the assistant's turn
    end = ids["<|im_end|>"] if name == "qwen" else ids["<|eot_id|>"]
    answer = whole[len(bare): whole.index(end, len(bare))]
    content, calls = S.parse_answer(fam, toolset, answer, tok)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert content is None
    if name == "llama":  # the same call after <|python_tag|>, a special token found on the ids
        tagged = [ids["<|python_tag|>"]] + answer
        assert S.parse_answer(fam, toolset, tagged, tok)[1][0].name == "get_weather"
        assert S.parse_answer(fam, toolset, tok.encode_plain("It is sunny."), tok) == ("It is sunny.", [])


def test_hermes_think_blocks_and_fenced_json():
    toolset = T.tool_set(TOOLS, "auto")
    call = '{"name": "get_time", "arguments": {"tz": 2}}'
    think = f"<think>\nmaybe <tool_call>\n{call}\n</tool_call>\n</think>\n\n"
    content, calls = hermes(toolset, think + f"<tool_call>\n{call}\n</tool_call>")
    assert [c.name for c in calls] == ["get_time"] and content.startswith("<think>") and "maybe" in content
    content, calls = hermes(toolset, think + "no call")
    assert calls == [] and content.endswith("no call")  # a call inside the reasoning is not a call
    # Qwen2.5-Coder's fenced JSON: a call only when exactly a call to a given tool with valid arguments.
    content, calls = hermes(toolset, f"Sure.\n```json\n{call}\n```")
    assert [c.name for c in calls] == ["get_time"] and content.strip() == "Sure."
    for other in ('{"name": "get_time", "arguments": {"tz": 99}}',  # out of the schema
                  '{"name": "launch", "arguments": {}}',  # no such tool
                  '{"name": "get_time", "arguments": {"tz": 2}, "x": 1}',  # more than a call
                  '{"a": 1}'):
        text = f"Here:\n```json\n{other}\n```"
        assert hermes(toolset, text) == (text, [])


def test_bad_tools_are_request_errors():
    cases = [([{"type": "custom", "custom": {"name": "x"}}], None, "tools[0].type"),
             ([{"type": "function", "function": {"name": "a b"}}], None, "tools[0].function.name"),
             (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
             (TOOLS, {"type": "allowed_tools", "allowed_tools": {}}, "tool_choice"),
             (TOOLS, "sometimes", "tool_choice"),
             (None, "required", "tool_choice")]
    for tools, choice, param in cases:
        with pytest.raises(InvalidRequestError) as info:
            T.tool_set(tools, choice)
        assert info.value.param == param, (tools, choice)
    bad = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{tz: 2"}}
    with pytest.raises(InvalidRequestError) as info:
        T.history(ASK + [{"role": "assistant", "content": ""}], [None, [bad]])
    assert info.value.param == "messages[1].tool_calls[0].function.arguments"
    with pytest.raises(InvalidRequestError) as info:
        T.history(ASK + [{"role": "tool", "content": "x", "tool_call_id": "c9"}], [None, None])
    assert info.value.param == "messages[1].tool_call_id"


def test_strict_tools_need_a_schema_strict_mode_can_honour():
    def strict(params):
        return [{"type": "function", "function": {"name": "f", "strict": True, "parameters": params}}]

    exact = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": ["string", "null"]}},
                                                    "required": ["b"], "additionalProperties": False},
                                              "c": {"type": "array", "items": {"anyOf": [{"type": "integer"}]}}},
             "required": ["a", "c"], "additionalProperties": False}
    assert T.tool_set(strict(exact), "auto").tools[0].strict
    nested = json.loads(json.dumps(exact))
    del nested["properties"]["a"]["additionalProperties"]
    cases = [({"type": "string"}, "root"), ({**exact, "additionalProperties": True}, "additionalProperties"),
             ({**exact, "required": ["a"]}, "'c' is not"), (nested, "parameters.properties.a: an object"),
             ({**exact, "properties": {**exact["properties"], "d": {"oneOf": []}}, "required": ["a", "c", "d"]},
              "'oneOf'")]
    for params, why in cases:
        with pytest.raises(InvalidRequestError) as info:
            T.tool_set(strict(params), "auto")
        assert info.value.param == "tools[0].function.parameters" and why in str(info.value), (params, str(info.value))
    # Not strict: the same schemas are taken (a call follows them as the grammar engine reads them).
    assert not T.tool_set([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
                          ).tools[0].strict


def test_a_schema_the_grammar_engine_refuses_is_a_400(family):
    _, _, _, engine = family
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "string", "pattern": "(?=a)b"}}}
    toolset = T.tool_set([bad], "required")
    with pytest.raises(InvalidRequestError) as info:
        engine.compile_structured(T.constraint(T.family_of(engine.tokenizer.chat_template), toolset, engine.tokenizer))
    assert info.value.param == "tools"


def test_a_pattern_past_the_budget_is_a_400_at_compile_not_a_failed_row(family, monkeypatch):
    """The grammar engine builds a string pattern's lexer only when a call reaches the string: each
    pattern is probed on its own at compile. Under a small lexer budget a pattern that the call's
    own probe passes (its lexer is not built at the call's first token) is refused at compile."""
    from llguidance import LLParserLimits

    from specdec import structured

    _, _, _, engine = family
    fam = T.family_of(engine.tokenizer.chat_template)
    engine.compile_structured(T.constraint(fam, T.tool_set(TOOLS, "required"), engine.tokenizer))  # tokens built
    monkeypatch.setattr(structured, "_limits", lambda: LLParserLimits(verbose_errors=False, step_lexer_fuel=300))
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "[ab]*a[ab]{30}"}}, "required": ["a"]}}}
    toolset = T.tool_set([TIME, tool], "required")
    constraint = T.constraint(fam, toolset, engine.tokenizer)
    with pytest.raises(InvalidRequestError) as info:
        engine.compile_structured(constraint)
    assert info.value.param == "tools[1].function.parameters.properties.a.pattern"
    assert "gave up" in str(info.value)
    # Without the probe the call compiles, and fails only once generation reaches the string.
    state = structured.compile_spec(structured.StructuredSpec("grammar", T.call_grammar(fam, toolset, False,
                                                                                        constraint.marks)),
                                    engine._grammar_tokens, constraint.marks or ())
    with pytest.raises(InvalidRequestError):
        state.advance(engine.tokenizer.encode_plain('<tool_call>\n{"name": "f", "arguments": {"a": "'
                                                    if fam is T.HERMES else '{"name": "f", "parameters": {"a": "'))
        state._mask()
    # A tool without a pattern under the same budget, and the same pattern at the default budget: fine.
    engine.compile_structured(T.constraint(fam, T.tool_set([TIME], "required"), engine.tokenizer))
    monkeypatch.undo()
    engine.compile_structured(constraint)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_constrained_calls_are_valid_for_many_seeds(family, choice):
    _, _, _, engine = family
    toolset = T.tool_set(TOOLS, choice, parallel=False)
    fam = T.family_of(engine.tokenizer.chat_template)
    constraint = T.constraint(fam, toolset, engine.tokenizer)
    prompt = render(engine, toolset)
    spec = Engine(engine.model, engine.tokenizer, drafter=NgramDrafter(), num_speculative_tokens=4)
    finished = 0
    for seed in range(60):
        out = spec.generate(prompt_ids=prompt, max_new_tokens=100, structured=constraint,
                            sampling=SamplingParams(temperature=1.0, seed=seed))
        content, calls = S.parse_answer(fam, toolset, out.token_ids, engine.tokenizer)
        if out.finish_reason == "stop":
            finished += 1
            assert content is None and len(calls) == 1
            assert_valid(calls)
            if isinstance(choice, dict):
                assert calls[0].name == "get_time"
    assert finished >= 40  # the rest ran out of tokens in a string of random bytes


def drafters(folder, prompt, truth):
    draft = Engine.load(str(folder), dtype="float32").model  # the same weights: long accepted runs
    return [NgramDrafter(), SuffixDrafter(), DraftModelDrafter(draft, 272, draft_p_min=0.0), Oracle(prompt, truth)]


@pytest.mark.parametrize("choice", ["required", "get_weather", "auto"])
def test_greedy_identity_with_every_drafter(family, choice):
    name, folder, ids, engine = family
    tool_choice = {"type": "function", "function": {"name": choice}} if choice == "get_weather" else choice
    toolset = T.tool_set(TOOLS, tool_choice, parallel=choice == "get_weather")
    fam = T.family_of(engine.tokenizer.chat_template)
    constraint = T.constraint(fam, toolset, engine.tokenizer)
    prompt = render(engine, toolset)
    # Under auto a random model never opens a call by itself: a logit bias makes it, after some text.
    # (Llama: a bias on "{", which opens a bare JSON call as the answer's first token.)
    opening = ids["<tool_call>"] if name == "qwen" else engine.tokenizer.encode_plain("{")[0]
    params = SamplingParams(logit_bias=((opening, 9.0),)) if choice == "auto" else SamplingParams()
    want = engine.generate(prompt_ids=prompt, max_new_tokens=70, structured=constraint, sampling=params,
                           speculative=False)
    if choice == "auto":
        assert opening in want.token_ids and want.finish_reason == "stop"
    content, calls = S.parse_answer(fam, toolset, want.token_ids, engine.tokenizer)
    if want.finish_reason == "stop":
        assert_valid(calls)
    accepted = 0
    for drafter in drafters(folder, prompt, want.token_ids):
        spec = Engine(engine.model, engine.tokenizer, drafter=drafter, num_speculative_tokens=4, draft_length="fixed")
        got = spec.generate(prompt_ids=prompt, max_new_tokens=70, structured=constraint, sampling=params)
        assert got.token_ids == want.token_ids, drafter.name
        accepted += got.stats.accepted_tokens
    assert accepted > 20


class Silent(DrafterBase):
    """A drafter with no guesses, counting its asks: every accepted draft is a forced one."""

    name = "silent"

    def __init__(self):
        self.asked = 0

    def propose(self, context, k):
        self.asked += 1
        return Proposal([])


@pytest.mark.parametrize("choice", ["required", "get_weather", "auto", "response_format"])
def test_forced_tokens_are_drafted_and_greedy_output_is_unchanged(family, choice, monkeypatch):
    """The grammar's forced tokens (the call's skeleton, a named function's name, required keys)
    drafted as one-hot drafts: greedy output equals plain constrained decoding, with and without
    them; with them the target runs fewer forwards, and the drafter is not asked at those steps."""
    from specdec import step

    name, folder, ids, engine = family
    tool_choice = {"type": "function", "function": {"name": choice}} if choice == "get_weather" else choice
    toolset = T.tool_set(TOOLS, "required" if choice == "response_format" else tool_choice, parallel=False)
    fam = T.family_of(engine.tokenizer.chat_template)
    constraint = T.constraint(fam, toolset, engine.tokenizer)
    if choice == "response_format":
        constraint = {"json": SCHEMAS["get_weather"]}
    opening = ids["<tool_call>"] if name == "qwen" else engine.tokenizer.encode_plain("{")[0]
    params = SamplingParams(logit_bias=((opening, 9.0),)) if choice == "auto" else SamplingParams()
    prompt = render(engine, toolset)
    kw = dict(prompt_ids=prompt, max_new_tokens=80, structured=constraint, sampling=params)
    want = engine.generate(**kw, speculative=False)
    silent = Silent()
    spec = Engine(engine.model, engine.tokenizer, drafter=silent, num_speculative_tokens=4, draft_length="fixed")
    got = spec.generate(**kw)
    assert got.token_ids == want.token_ids
    assert got.stats.accepted_tokens >= 15 and got.stats.target_forwards < len(got.token_ids) - 15
    assert silent.asked < got.stats.target_forwards  # forced steps did not ask the drafter
    monkeypatch.setattr(step, "forced_tokens", lambda row, cap: [])
    without = spec.generate(**kw)
    assert without.token_ids == want.token_ids and without.stats.accepted_tokens == 0
    # With a drafter that has guesses of its own too.
    ngram = Engine(engine.model, engine.tokenizer, drafter=NgramDrafter(), num_speculative_tokens=4)
    monkeypatch.undo()
    assert ngram.generate(**kw).token_ids == want.token_ids


def test_lazy_masks_follow_the_call_grammar_after_a_drafted_opening(family):
    """Where the opening is drafted inside a block, every later row of that block is masked as a
    call grammar started at the token after the opening says; rows before it are free."""
    name, _, ids, engine = family
    if name != "qwen":
        pytest.skip("the hermes opening")
    toolset = T.tool_set(TOOLS, "auto")
    constraint = T.constraint(T.HERMES, toolset, engine.tokenizer)
    lazy = engine.compile_structured(constraint)
    enc, open_ = engine.tokenizer.encode_plain, ids["<tool_call>"]
    call = enc('\n{"name": "get_time", "arguments": {"tz": 3}}\n') + [ids["</tool_call>"]]
    paths = [[], enc("Hi"), enc("Hi") + [open_], enc("Hi") + [open_] + call[:3], [open_] + call[:9],
             [open_] + enc("\nxyz")]
    masks = lazy.masks(paths)
    ref = T.ToolConstraint(T.HERMES, toolset, open_, constraint.marks)
    for j, path in enumerate(paths):
        if open_ not in path:
            assert masks[j].all()
            continue
        fresh = engine.compile_structured(ref).scratch
        tail = path[path.index(open_) + 1:]
        if fresh.matcher.validate_tokens(tail) < len(tail):
            assert masks[j].all()  # unreachable: the draft is rejected before this row
            continue
        fresh.advance(tail)
        assert torch.equal(masks[j], fresh._mask()), path
    assert masks[3].sum() < 10 and not masks[3][open_]  # inside the call: JSON, not free text
    # Committing text, then the opening and part of a call, moves the constraint along.
    lazy.advance(enc("Hi"))
    assert lazy.active is None and lazy.masks([[]]).all()
    lazy.advance([open_] + call[:3])
    fresh = engine.compile_structured(ref).scratch
    fresh.advance(call[:3])
    assert torch.equal(lazy.masks([[]])[0], fresh._mask())


def test_sampled_calls_with_drafting_follow_plain_constrained_sampling(family, monkeypatch):
    """Two-sample chi-square: the argument a named call samples at temperature 1, with the call's
    forced skeleton drafted as forced tokens and an n-gram drafter drafting the choice from the
    prompt, against plain constrained sampling (the distribution speculation must keep)."""
    from scipy.stats import chi2_contingency

    from specdec import step

    forced_steps, forced_tokens = [], step.forced_tokens
    monkeypatch.setattr(step, "forced_tokens", lambda row, cap: (f := forced_tokens(row, cap)) and
                        (forced_steps.append(len(f)) or f))

    name, _, _, engine = family
    if name != "qwen":
        pytest.skip("one family is enough for the distribution")
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"u": {"enum": ["a", "b", "c", "d"]}}, "required": ["u"],
        "additionalProperties": False}}}
    toolset = T.tool_set([tool], {"type": "function", "function": {"name": "f"}}, parallel=False)
    constraint = T.constraint(T.HERMES, toolset, engine.tokenizer)
    # The prompt holds the skeleton with other choices, so the drafter proposes the choice too.
    prompt = engine.tokenizer.encode_plain('{"name": "f", "arguments": {"u": "b"}} {"name": "f", "arguments": '
                                           '{"u": "d"}} {"name": "f", "arguments": {"u": "')
    spec = Engine(engine.model, engine.tokenizer, drafter=NgramDrafter(), num_speculative_tokens=6,
                  draft_length="fixed")
    counts, drafted = {True: {}, False: {}}, 0
    n = 150
    for speculative in (True, False):
        for seed in range(n):
            out = spec.generate(prompt_ids=prompt, max_new_tokens=45, structured=constraint, speculative=speculative,
                                sampling=SamplingParams(temperature=1.0, seed=1000 * speculative + seed))
            value = json.loads(S.parse_answer(T.HERMES, toolset, out.token_ids, engine.tokenizer)[1][0].arguments)["u"]
            counts[speculative][value] = counts[speculative].get(value, 0) + 1
            drafted += out.stats.accepted_tokens
    cells = sorted(set(counts[True]) | set(counts[False]))
    table = [[counts[s].get(c, 0) for c in cells] for s in (True, False)]
    assert len(cells) >= 2 and drafted > n * 10 and len(forced_steps) >= n  # forced drafts at least once a call
    assert chi2_contingency(table)[1] > 1e-3, table


def hermes(toolset, text):
    return S.parse_text(T.HERMES, toolset, text, None)


def streamed(family, toolset, tok, ids, step):
    """The events of an answer pushed `step` tokens at a time, and the events each push returned."""
    scanner, pushes = S.CallScanner(family, toolset, tok), []
    for at in range(0, len(ids), step):
        pushes.append(scanner.push(tok.decode(ids[at: at + step]), ids[at: at + step]))
    return pushes, scanner.finish()


def test_a_stream_sends_text_then_the_call_head_then_its_arguments_as_written(family):
    """Content goes out until the opening; the call's name as soon as it is written; each push
    inside the arguments sends what it added; pushed in any split the events assemble into the
    whole answer's parse."""
    name, _, ids, engine = family
    tok = engine.tokenizer
    toolset = T.tool_set(TOOLS, "auto")
    fam = T.family_of(tok.chat_template)
    args = '{"city": "Paris", "unit": "c"}'
    if name == "qwen":
        call = tok.encode_plain(f'\n{{"name": "get_weather", "arguments": {args}}}\n')
        answers = [(tok.encode_plain("Let me check.\n") + [ids["<tool_call>"]] + call + [ids["</tool_call>"]],
                    "Let me check.")]
    else:  # after <|python_tag|>, and a bare JSON answer
        call = tok.encode_plain(f'{{"name": "get_weather", "parameters": {args}}}')
        answers = [(tok.encode_plain("Let me check.") + [ids["<|python_tag|>"]] + call, "Let me check."),
                   (tok.encode_plain(" ") + call, None)]
    for answer, content_before in answers:
        whole = S.parse_answer(fam, toolset, answer, tok)
        assert whole[0] == content_before and [(c.name, c.arguments) for c in whole[1]] == [("get_weather", args)]
        for step in (1, 2, 3, 7, len(answer)):
            pushes, last = streamed(fam, toolset, tok, answer, step)
            content, calls = S.assemble([e for p in pushes for e in p] + last)
            assert (content, [(c.name, c.arguments) for c in calls]) == (whole[0], [(c.name, c.arguments)
                                                                               for c in whole[1]]), step
        pushes, last = streamed(fam, toolset, tok, answer, 1)
        kinds = [[e[0] for e in p] for p in pushes]
        first_call = next(i for i, k in enumerate(kinds) if "call" in k)
        assert "content" not in [e[0] for p in pushes[first_call:] for e in p] + [e[0] for e in last]
        fragments = [e[2] for p in pushes for e in p if e[0] == "args"]
        assert len(fragments) == len(args) and "".join(fragments) == args  # one byte per token: one per push
        assert not [e for e in last if e[0] != "content"]  # nothing of the call waited for the end


def test_a_fence_waits_for_its_close_and_text_with_backticks_stays_content():
    toolset = T.tool_set(TOOLS, "auto")
    call = '{"name": "get_time", "arguments": {"tz": 2}}'
    for text, want in [("Use `ls` here.", ("Use `ls` here.", [])),
                       ("Run ```bash\nls\n``` ok", ("Run ```bash\nls\n``` ok", [])),
                       (f"Sure.\n```json\n{call}\n```\nDone", ("Sure.\n\nDone", [("get_time", '{"tz": 2}')])),
                       ('<tool_call>\n{"arguments": {"tz": 2}, "name": "get_time"}\n</tool_call>',
                        (None, [("get_time", '{"tz": 2}')])),
                       ("a <tool_call>\nnot json\n</tool_call>", ("a <tool_call>\nnot json\n</tool_call>", []))]:
        scanner, events = S.CallScanner(T.HERMES, toolset, None), []
        for ch in text:
            events += scanner.push(ch)
            held = "".join(e[1] for e in events if e[0] == "content")
            assert text.startswith(held) or want[1]  # content never runs ahead of the text
        content, calls = S.assemble(events + scanner.finish())
        assert (content, [(c.name, c.arguments) for c in calls]) == want, text
        assert S.parse_text(T.HERMES, toolset, text, None)[0] == want[0]


def test_only_the_first_call_without_parallel_calls():
    toolset = T.tool_set(TOOLS, "auto", parallel=False)
    one = '<tool_call>\n{"name": "get_time", "arguments": {"tz": 2}}\n</tool_call>'
    content, calls = hermes(toolset, one + "\n" + one.replace("2", "3"))
    assert content is None and [c.arguments for c in calls] == ['{"tz": 2}']


def test_llama_auto_opens_a_call_only_at_the_answers_first_token(family):
    """Llama's bare JSON call: a first token the call grammar can begin with starts the constraint
    (rows after it masked), the same token later in the answer is free text."""
    name, _, ids, engine = family
    if name != "llama":
        pytest.skip("Llama's bare JSON calls")
    toolset = T.tool_set(TOOLS, "auto")
    constraint = T.constraint(T.LLAMA3, toolset, engine.tokenizer)
    lazy = engine.compile_structured(constraint)
    enc = engine.tokenizer.encode_plain
    brace = enc("{")
    masks = lazy.masks([[], brace, enc("Hi") + brace, [ids["<|python_tag|>"]] + brace])
    assert masks[0].all() and masks[2].all()
    assert masks[1].sum() == 1 and masks[1][enc('"')[0]]  # inside the call: its JSON, key by key
    assert torch.equal(masks[3], masks[1])  # after <|python_tag|> too
    lazy.advance(enc("Hi"))
    assert lazy.masks([brace])[0].all()
