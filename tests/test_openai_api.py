"""The OpenAI API, complete and honest, in every FastAPI stage: logprobs (completions and chat, streamed
and not), echo and prompt logprobs, penalties and logit_bias, and a 400 naming every OpenAI field a
stage cannot honour. Logprobs are checked against Hugging Face's float32 logits at the same positions;
every response is read with the official ``openai`` client, so its typed objects parse each shape."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from .conftest import stage
from .prompts import CHAT_PROMPTS, TEXT_PROMPTS
from .sampling import OneRow
from .stages import FASTAPI_STAGES, graded_first, has

MODEL = "smollm2-135m-instruct"
ATOL = 1e-4  # float32 logprobs: ours against Hugging Face's at the same position


@pytest.fixture(params=FASTAPI_STAGES)
def server(request):
    return request.getfixturevalue(f"server{request.param[:2]}")


@pytest.fixture(scope="session")
def tokenizer(hf):
    return hf[1]


def chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The prompt the servers build for a conversation (see Engine.encode_chat)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="session")
def hf_logprobs(hf):
    """hf_logprobs(ids) -> log_softmax of Hugging Face's float32 logits at every position: [T, V]."""
    model, _ = hf
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def run(ids: list[int]) -> torch.Tensor:
        if tuple(ids) not in cache:
            with torch.inference_mode():
                logits = model(torch.tensor([ids])).logits[0].float()
            cache[tuple(ids)] = torch.log_softmax(logits, dim=-1)
        return cache[tuple(ids)]

    return run


def expected_scores(hf_logprobs, ids: list[int], first: int, k: int) -> tuple[list[float], list[list[float]]]:
    """Hugging Face's logprob of ids[j], and its k best logprobs, for every j >= first (j >= 1)."""
    logprobs = hf_logprobs(ids)
    chosen = [logprobs[j - 1, ids[j]].item() for j in range(first, len(ids))]
    top = [torch.topk(logprobs[j - 1], k).values.tolist() for j in range(first, len(ids))]
    return chosen, top


def join_completion_chunks(chunks) -> tuple[str, dict[str, list]]:
    """A streamed completion's text and its logprobs lists, chunk after chunk."""
    text, lists = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text += choice.text
        if choice.logprobs is not None:
            for name, values in lists.items():
                values.extend(getattr(choice.logprobs, name))
    return text, lists


def completion_logprobs(client, stream: bool, **kwargs) -> tuple[str, dict[str, list], str]:
    if stream:
        chunks = list(client.completions.create(model=MODEL, stream=True, **kwargs))
        text, lists = join_completion_chunks(chunks)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return text, lists, finish[-1]
    choice = client.completions.create(model=MODEL, **kwargs).choices[0]
    lists = {name: getattr(choice.logprobs, name) for name in ("tokens", "token_logprobs", "top_logprobs",
                                                               "text_offset")}
    return choice.text, lists, choice.finish_reason


def assert_offsets_and_join(text: str, lists: dict[str, list]) -> None:
    assert "".join(lists["tokens"]) == text
    offsets = [sum(len(t) for t in lists["tokens"][:i]) for i in range(len(lists["tokens"]))]
    assert lists["text_offset"] == offsets


def assert_top_is_the_true_top_k(top: dict[str, float] | list, chosen: float, expected_top: list[float]) -> None:
    """The k best (sorted, as Hugging Face has them), plus the chosen token in the completions dict."""
    values = sorted(top.values(), reverse=True) if isinstance(top, dict) else [t.logprob for t in top]
    k = len(expected_top)
    if isinstance(top, dict):  # OpenAI's rule: the k best, and the chosen token if it is not among them
        assert len(values) in (k, k + 1) and any(abs(v - chosen) < ATOL for v in values)
        values = values[:k]
    else:
        assert values == sorted(values, reverse=True), "best first"
    assert values == pytest.approx(expected_top, abs=ATOL)


# --- completions: logprobs, echo, prompt logprobs ------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_logprobs_with_echo_equal_hf(server, hf_logprobs, hf_greedy, tokenizer, stream):
    prompt = TEXT_PROMPTS[0]
    prompt_ids = tokenizer(prompt).input_ids
    output_ids = hf_greedy(prompt_ids, 8)
    text, lists, finish = completion_logprobs(server.client(), stream, prompt=prompt, max_tokens=8, temperature=0,
                                              logprobs=5, echo=True)
    assert text == prompt + tokenizer.decode(output_ids) and finish == "length"
    assert_offsets_and_join(text, lists)
    ids = prompt_ids + output_ids
    assert len(lists["token_logprobs"]) == len(ids)
    assert lists["token_logprobs"][0] is None and lists["top_logprobs"][0] is None  # nothing predicts token 0
    chosen, top = expected_scores(hf_logprobs, ids, 1, 5)
    assert lists["token_logprobs"][1:] == pytest.approx(chosen, abs=ATOL)
    for got, lp, expected in zip(lists["top_logprobs"][1:], chosen, top, strict=True):
        assert_top_is_the_true_top_k(got, lp, expected)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_logprobs_without_echo_cover_only_the_output(server, hf_logprobs, hf_greedy, tokenizer, stream):
    prompt = TEXT_PROMPTS[1]
    prompt_ids = tokenizer(prompt).input_ids
    output_ids = hf_greedy(prompt_ids, 6)
    text, lists, _ = completion_logprobs(server.client(), stream, prompt=prompt, max_tokens=6, temperature=0,
                                         logprobs=0)
    assert text == tokenizer.decode(output_ids)
    assert_offsets_and_join(text, lists)
    chosen, _ = expected_scores(hf_logprobs, prompt_ids + output_ids, len(prompt_ids), 1)
    assert lists["token_logprobs"] == pytest.approx(chosen, abs=ATOL)
    assert all(len(top) == 1 for top in lists["top_logprobs"])  # logprobs: 0 is the chosen token alone


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_max_tokens_zero_with_echo_scores_the_prompt(server, hf_logprobs, tokenizer, stream):
    """The log-likelihood query of evaluation harnesses: the prompt back, every token scored, nothing new."""
    prompt = "The quick brown fox jumps over the lazy dog"
    prompt_ids = tokenizer(prompt).input_ids
    text, lists, finish = completion_logprobs(server.client(), stream, prompt=prompt, max_tokens=0, echo=True,
                                              logprobs=2)
    assert text == prompt and finish == "length"
    assert_offsets_and_join(text, lists)
    chosen, top = expected_scores(hf_logprobs, prompt_ids, 1, 2)
    assert lists["token_logprobs"][0] is None
    assert lists["token_logprobs"][1:] == pytest.approx(chosen, abs=ATOL)
    for got, lp, expected in zip(lists["top_logprobs"][1:], chosen, top, strict=True):
        assert_top_is_the_true_top_k(got, lp, expected)
    usage = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True).usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), 0)


def test_echo_without_logprobs_puts_the_prompt_first(server, hf_greedy, tokenizer):
    prompt = TEXT_PROMPTS[2]
    choice = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                                echo=True).choices[0]
    assert choice.text == prompt + tokenizer.decode(hf_greedy(tokenizer(prompt).input_ids, 5))
    assert choice.logprobs is None
    chunks = list(server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                                     echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith(prompt)  # the prompt comes in the first chunk
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text


def test_tokens_join_to_the_text_when_a_stop_string_cuts_it(server, tokenizer):
    client = server.client()
    prompt = TEXT_PROMPTS[0]
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    stop = full[9:13]  # from the middle of the answer: the cut lands inside a token, or between two
    assert stop.strip() and full.find(stop) == 9
    for stream in (False, True):
        text, lists, finish = completion_logprobs(client, stream, prompt=prompt, max_tokens=16, temperature=0,
                                                  logprobs=1, stop=[stop])
        assert text == full[:9] and finish == "stop"
        assert_offsets_and_join(text, lists)


def test_tokens_join_to_the_text_across_multibyte_characters(server, tokenizer):
    """CJK characters take several byte-level tokens: a token that ends mid-character releases ""."""
    prompt = TEXT_PROMPTS[3]
    for stream in (False, True):
        text, lists, _ = completion_logprobs(server.client(), stream, prompt=prompt, max_tokens=12, temperature=0,
                                             logprobs=1, echo=True)
        assert_offsets_and_join(text, lists)
        assert "\ufffd" not in text and len(lists["tokens"]) == len(tokenizer(prompt).input_ids) + 12
    assert "" in lists["tokens"]  # this prompt's answer does split a character between tokens


# --- chat ----------------------------------------------------------------------------------------------


def chat_logprobs(client, stream: bool, **kwargs) -> tuple[str, list]:
    if stream:
        chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        content = [entry for c in chunks if c.choices and c.choices[0].logprobs
                   for entry in c.choices[0].logprobs.content]
        return text, content
    choice = client.chat.completions.create(model=MODEL, **kwargs).choices[0]
    return choice.message.content, choice.logprobs.content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_logprobs_equal_hf(server, hf_logprobs, hf_greedy, tokenizer, stream):
    messages = [{"role": "user", "content": CHAT_PROMPTS[1]}]
    prompt_ids = chat_ids(tokenizer, messages)
    output_ids = hf_greedy(prompt_ids, 8)
    text, content = chat_logprobs(server.client(), stream, messages=messages, max_tokens=8, temperature=0,
                                  logprobs=True, top_logprobs=4)
    assert text == tokenizer.decode(output_ids, skip_special_tokens=True)
    assert "".join(entry.token for entry in content) == text
    assert all(entry.bytes == list(entry.token.encode()) for entry in content)
    chosen, top = expected_scores(hf_logprobs, prompt_ids + output_ids, len(prompt_ids), 4)
    assert [entry.logprob for entry in content] == pytest.approx(chosen, abs=ATOL)
    for entry, lp, expected in zip(content, chosen, top, strict=True):
        assert len(entry.top_logprobs) == 4
        assert all(t.bytes == list(t.token.encode()) for t in entry.top_logprobs)
        assert_top_is_the_true_top_k(entry.top_logprobs, lp, expected)


def test_chat_without_logprobs_returns_none_and_top_logprobs_needs_logprobs(server):
    client = server.client()
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0)
    assert client.chat.completions.create(**kwargs).choices[0].logprobs is None
    content = client.chat.completions.create(logprobs=True, **kwargs).choices[0].logprobs.content
    assert len(content) == 2 and all(entry.top_logprobs == [] for entry in content)
    response = httpx.post(f"{server.url}/v1/chat/completions", json={**kwargs, "top_logprobs": 2}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"


# --- sampling is not changed by asking for logprobs ------------------------------------------------------


def test_a_seeded_sample_is_the_same_with_and_without_logprobs(server):
    client = server.client()
    kwargs = dict(model=MODEL, prompt=TEXT_PROMPTS[0], max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    plain = client.completions.create(**kwargs).choices[0].text
    scored = client.completions.create(logprobs=5, echo=True, **kwargs).choices[0]
    assert scored.text == TEXT_PROMPTS[0] + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, logprobs=2, **kwargs)
                       if c.choices)
    assert streamed == plain


# --- penalties and logit_bias ------------------------------------------------------------------------------


def penalized_greedy(hf, prompt_ids: list[int], n: int, presence: float, frequency: float,
                     bias: dict[int, float]) -> list[int]:
    """The definition, computed directly on Hugging Face's logits: greedy over penalized logits."""
    model, _ = hf
    output: list[int] = []
    for _ in range(n):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt_ids + output])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[-1]).float()
        logits = logits - frequency * counts - presence * (counts > 0).float()
        for token_id, value in bias.items():
            logits[token_id] += value
        output.append(int(torch.argmax(logits)))
    return output


@pytest.fixture(scope="module")
def penalized_case(hf, tokenizer, references):
    prompt = "Repeat after me: hello hello hello hello hello"
    prompt_ids = tokenizer(prompt).input_ids
    bias = {tokenizer(" world").input_ids[0]: 1.5, tokenizer(" hello").input_ids[0]: -0.5}
    settings = dict(presence=0.5, frequency=0.3, bias=bias)

    def reference(presence: float, frequency: float, bias: dict[int, float]) -> list[int]:  # kept on disk
        key = json.dumps([prompt_ids, presence, frequency, sorted(bias.items())])
        return references("penalized").get(key, lambda: penalized_greedy(hf, prompt_ids, 10, presence, frequency, bias))

    expected = reference(**settings)
    # Each of the three changes this answer, so a server that drops any one of them fails the tests.
    for dropped in (dict(presence=0.0), dict(frequency=0.0), dict(bias={})):
        assert reference(**{**settings, **dropped}) != expected, dropped
    return prompt, prompt_ids, settings, expected


def test_penalties_and_bias_follow_openais_definition(server, tokenizer, penalized_case):
    prompt, _, settings, expected = penalized_case
    text = server.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, presence_penalty=settings["presence"],
        frequency_penalty=settings["frequency"], logit_bias={str(k): v for k, v in settings["bias"].items()},
    ).choices[0].text
    assert text == tokenizer.decode(expected)


@pytest.mark.parametrize("folder", FASTAPI_STAGES)
def test_apply_penalties_on_one_row(folder):
    sampler = OneRow(folder)
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    output_ids = [3, 3, 7, 3, 12]
    params = sampler.SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25, logit_bias={7: 2.0, 40: -100.0})
    expected = logits.clone()
    for token_id, count in ((3, 3), (7, 1), (12, 1)):
        expected[token_id] -= -0.25 * count + 0.5
    expected[7] += 2.0
    expected[40] -= 100.0
    assert torch.allclose(sampler.apply_penalties(logits, output_ids, params), expected)
    assert torch.equal(sampler.apply_penalties(logits, output_ids, sampler.SamplingParams()), logits)


@pytest.mark.parametrize("folder", graded_first(FASTAPI_STAGES, "2.5"))
def test_compute_logprobs_is_the_log_softmax_of_the_raw_logits(folder):
    sampler = OneRow(folder)
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)) * 4
    expected = torch.log_softmax(logits.double(), dim=-1)
    token_ids = [0, 17, 63, 17, 5]
    for k in (0, 1, 7):
        got = sampler.compute_logprobs(logits, token_ids, k)
        assert [g.token_id for g in got] == token_ids
        for row, g in enumerate(got):
            assert g.logprob == pytest.approx(expected[row, token_ids[row]].item(), abs=1e-5)
            best = torch.topk(expected[row], k)
            assert [t for t, _ in g.top] == best.indices.tolist()  # the true top k, best first
            assert [lp for _, lp in g.top] == pytest.approx(best.values.tolist(), abs=1e-5)
    # The prompt's rows: row i scores token i + 1; a one-token prompt has no rows at all.
    assert sampler.compute_logprobs(logits[:0], [], 3) == []


def test_batched_penalties_equal_each_row_alone():
    batched, single = stage("04_continuous_batching", "sampler"), stage("03_paged_kv", "sampler")
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 60, generator=gen)
    params = [batched.SamplingParams(), batched.SamplingParams(presence_penalty=1.5, logit_bias={2: 3.0}),
              batched.SamplingParams(frequency_penalty=0.7), batched.SamplingParams(logit_bias={5: -2.0, 9: 1.0})]
    output_ids = [[1, 1], [4, 4, 4, 2], [8, 9, 8], []]
    got = batched.apply_penalties(logits, params, output_ids)
    for row, (p, ids) in enumerate(zip(params, output_ids, strict=True)):
        alone = single.SamplingParams(presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                                      logit_bias=p.logit_bias)
        assert torch.allclose(got[row], single.apply_penalties(logits[row], ids, alone)), row
    assert torch.equal(logits, torch.randn(4, 60, generator=torch.Generator().manual_seed(1)))  # raw logits kept


def test_batched_logprobs_only_for_rows_that_asked():
    sampler = stage("04_continuous_batching", "sampler")
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    got = sampler.compute_logprobs(logits, [5, 6, 7], [2, None, 0])
    expected = torch.log_softmax(logits, dim=-1)
    assert got[1] is None
    assert got[0].logprob == pytest.approx(expected[0, 5].item()) and got[2].top == []
    assert [t for t, _ in got[0].top] == torch.topk(expected[0], 2).indices.tolist()


def test_a_penalized_request_gives_the_same_tokens_alone_and_in_a_batch(engine04, penalized_case, tokenizer):
    """Penalties are one vectorized operation over the batch: a row's tokens do not depend on its neighbours."""
    _, prompt_ids, settings, expected = penalized_case
    sampler = stage("04_continuous_batching", "sampler")
    mine = sampler.SamplingParams(max_tokens=10, temperature=0.0, presence_penalty=settings["presence"],
                                  frequency_penalty=settings["frequency"], logit_bias=settings["bias"])
    assert engine04.generate_offline([prompt_ids], mine) == [expected]
    others = [sampler.SamplingParams(max_tokens=6 + i % 5, temperature=0.0 if i % 2 else 0.8, seed=i, top_k=i % 4,
                                     frequency_penalty=(i % 3) * 0.5, logit_bias={i: 1.0} if i % 4 == 0 else {},
                                     logprobs=i % 3 if i % 2 else None)
              for i in range(15)]
    prompts = [tokenizer(p).input_ids for p in (TEXT_PROMPTS * 4)[:15]]
    outputs = engine04.generate_offline([*prompts, prompt_ids], [*others, mine])
    assert outputs[-1] == expected


# --- what a stage cannot honour is a 400 that names it --------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
REFUSED = [
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "suffix": "and then"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"hello": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias.5"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "service_tier": "priority"}, "service_tier"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {**CHAT, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {**CHAT, "prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {**CHAT, "reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {**CHAT, "web_search_options": {}}, "web_search_options"),
    ("/v1/chat/completions", {**CHAT, "store": True}, "store"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, "top_logprobs"),  # needs logprobs: true
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 25}, "top_logprobs"),
]


@pytest.mark.parametrize(("path", "body", "param"), REFUSED, ids=[f"{p[4:]}:{param}" for p, _, param in REFUSED])
def test_what_a_stage_cannot_honour_is_a_400_naming_it(server, path, body, param):
    response = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and param.split(".")[0] in \
        error["message"]


# n > 1 shares the prompt's blocks between the choices: the prefix cache's (stage 05's) shared, counted blocks.
@pytest.mark.parametrize("folder", [folder for folder in FASTAPI_STAGES if not has(folder, "prefix_cache")])
@pytest.mark.parametrize(("path", "body"), [("/v1/completions", {"prompt": "hi", "n": 3}),
                                            ("/v1/chat/completions", {**CHAT, "n": 2})], ids=["completions", "chat"])
def test_n_above_one_is_a_400_naming_it_before_stage_05(request, folder, path, body):
    server = request.getfixturevalue(f"server{folder[:2]}")
    response = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


def test_defaults_of_unsupported_fields_are_accepted(server):
    """Sending a field's default value asks for nothing the stage lacks."""
    body = {**CHAT, "max_tokens": 2, "n": 1, "tools": [], "response_format": {"type": "text"}, "store": False,
            "modalities": ["text"], "service_tier": "auto", "metadata": {"k": "v"}, "user": "u"}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    body = {"prompt": "hi", "max_tokens": 2, "best_of": 1, "suffix": None, "logit_bias": {}}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200


@pytest.mark.parametrize(("field", "value"), [("logprobs", 1), ("echo", True), ("presence_penalty", 0.5),
                                              ("frequency_penalty", 0.5), ("logit_bias", {"5": 1.0})])
def test_stage01_refuses_what_it_does_not_do(server01, field, value):
    response = httpx.post(f"{server01.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value},
                          timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == field
