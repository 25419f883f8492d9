"""``hf2q-py serve --memory-budget``: the real server process under a memory
budget, talked to with the official ``openai`` and ``anthropic`` clients: a
prompt over the budget is a 413 with the numbers while another request goes
on, requests that fit one at a time wait and all finish, a full memory
queue is a 429 on both APIs, a budget smaller than the model is a one-line
error, and the server's MLX peak memory stays within the budget."""

from __future__ import annotations

import subprocess
import threading
import time

import anthropic
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from scripted_model import write_cycling_folder
from server_process import running_server, server_command

import hf2q_py
from hf2q_py.budget import MemoryBudget, MemoryLedger, model_bytes

pytestmark = pytest.mark.slow

LONG = 2000  # tokens the long request may hold, by the budget
BASELINE = {
    "hf2q": {"method": "baseline"}
}  # the cycling answer drafts itself whole with n-grams: keep it slow


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_cycling_folder(tmp_path_factory.mktemp("cycling"))


@pytest.fixture(scope="module")
def budget(folder) -> int:
    """Room for one request of about ``LONG`` tokens, not for two requests."""
    target = hf2q_py.load(str(folder))
    book = MemoryLedger(target, MemoryBudget(1 << 30), 512)
    one = book.reserve(8, LONG, target.kv, width=1)
    budget = book.need([one]).total
    assert book.need([one, book.reserve(8, 4, target.kv, width=1)]).total > budget
    return budget


@pytest.fixture(scope="module")
def server(folder, budget):
    flags = ("--memory-budget", str(budget), "--memory-queue", "1", "--no-disk-cache")
    with running_server("--model", str(folder), *flags) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def metrics(server) -> dict[tuple[str, tuple], float]:
    text = server.raw("GET", "/metrics")[2].decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def long_request(client, out: dict) -> threading.Thread:
    """A streamed request asking far more than fits (cut to what fits);
    ``out["started"]`` is set at its first text, ``out["text"]`` at its end."""
    out["started"] = threading.Event()

    def run():
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "go"}], max_tokens=100_000, stream=True,
            extra_body=BASELINE,
        )  # fmt: skip
        text, finish = "", None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                out["started"].set()
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        out["text"], out["finish"] = text, finish

    thread = threading.Thread(target=run)
    thread.start()
    assert out["started"].wait(60)
    return thread


def test_a_prompt_over_the_budget_is_a_413_with_the_numbers_while_another_request_goes_on(
    server, client, claude
):
    out: dict = {}
    thread = long_request(client, out)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="m", prompt="x" * 3000, max_tokens=4)
    assert e.value.status_code == 413
    body = e.value.body
    assert body["code"] == "insufficient_memory" and body["type"] == "invalid_request_error"
    assert "prompt is too long for this server's memory: 3000 prompt tokens plus 4" in body["message"]
    assert "tokens (prompt and answer) fit" in body["message"] and "bytes per token" in body["message"]
    with pytest.raises(anthropic.APIStatusError) as e:
        claude.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "x" * 3000}])
    assert e.value.status_code == 413
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "request_too_large"
    assert "prompt is too long for this server's memory" in e.value.body["error"]["message"]
    thread.join(120)
    assert out["finish"] == "length" and len(out["text"]) > LONG // 2  # cut to what fits, and finished
    assert server.alive()


def test_requests_that_fit_one_at_a_time_wait_and_a_full_memory_queue_is_a_429_on_both_apis(
    server, client, claude
):
    before = metrics(server)
    out: dict = {}
    first = long_request(client, out)
    second: dict = {}

    def wait_for_memory():
        r = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "go"}], max_tokens=10, extra_body=BASELINE
        )
        second["text"], second["finish"] = r.choices[0].message.content, r.choices[0].finish_reason

    waiting = threading.Thread(target=wait_for_memory)
    waiting.start()
    deadline = time.monotonic() + 30
    while metrics(server)[("hf2q_memory_waiting", ())] < 1:
        assert time.monotonic() < deadline and "text" not in out, "the second request never waited for memory"
        time.sleep(0.02)
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=20)
    message = e.value.body["message"]
    assert e.value.body["code"] == "insufficient_memory"
    assert "the server's memory is full" in message and "max_tokens 20" in message
    assert "1 requests already wait for memory (at most 1)" in message and "tokens fit beside" in message
    with pytest.raises(anthropic.RateLimitError) as e:
        claude.messages.create(model="m", max_tokens=20, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "rate_limit_error"
    assert "the server's memory is full" in e.value.body["error"]["message"]
    first.join(120)
    waiting.join(120)
    assert out["finish"] == "length" and second == {"text": " !\"#$%&'()", "finish": "length"}
    after = metrics(server)
    refused = ("hf2q_memory_refusals_total", (("reason", "queue_full"),))
    assert after[refused] - before.get(refused, 0) == 2
    assert after[("hf2q_requests_total", (("endpoint", "/v1/messages"), ("status", "429")))] == 1


def test_the_metrics_give_the_bytes_by_kind_and_the_peak_stays_within_the_budget(
    server, client, folder, budget
):
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "go"}], max_tokens=50, extra_body=BASELINE
    )
    assert r.usage.completion_tokens == 50
    m = metrics(server)
    assert m[("hf2q_memory_budget_bytes", ())] == budget
    assert m[("hf2q_memory_bytes", (("kind", "weights"),))] == model_bytes(hf2q_py.load(str(folder)).model)
    assert m[("hf2q_memory_bytes", (("kind", "prompt_cache"),))] > 0  # the answers' states are kept
    assert ("hf2q_memory_bytes", (("kind", "kv_reserved"),)) in m
    assert m[("hf2q_memory_bytes", (("kind", "kv_in_use"),))] == 0  # nothing runs
    assert m[("hf2q_memory_clamped_total", ())] >= 1
    assert 0 < m[("hf2q_mlx_memory_bytes", (("kind", "peak"),))] <= budget


def test_a_budget_smaller_than_the_model_is_a_one_line_error(folder):
    out = subprocess.run(
        server_command("--model", str(folder), "--memory-budget", "64KB", "--port", "0"),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(
        "hf2q-py: error: the memory budget (--memory-budget 62.5 KiB) cannot hold this model"
    )
    assert "its weights take" in line and "give a larger --memory-budget" in line
