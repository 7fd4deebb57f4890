"""``kvlayer bench multi-round-qa|long-doc-qa --endpoint URL``: the HTTP mode.

Against a real ``kvlayer serve`` process (one per module; the tests that need it skip until
``kvlayer.serving`` exists): the JSON record of a tiny multi-round-qa and long-doc-qa run
(request counts, every request succeeded, TTFT > 0, the token counts the workload asks,
cached tokens on repeated prefixes), and a run whose every request fails (404: exit 2, one
line). Without a server: a refused connection and bad flags (one line, exit 2), and the
client's handling of streams a server may send (no ``token_ids``, an error event, a stream
cut short, a non-2xx status) through ``httpx.MockTransport``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json

import httpx
import pytest

from kvlayer.benchmarks.http_client import stream_completion
from kvlayer.benchmarks.http_driver import run_phase, summarize_http
from kvlayer.benchmarks.workloads import ChatSessions, MultiRoundSpec
from kvlayer.cli import main
from tests.redis_server import HOST, free_port

PNG = b"\x89PNG\r\n\x1a\n"
needs_serve = pytest.mark.skipif(importlib.util.find_spec("kvlayer.serving") is None,
                                 reason="kvlayer serve (kvlayer.serving) has not landed yet")
MRQA = ["--users", "3", "--rounds", "3", "--warmup-rounds", "1", "--system-tokens", "32", "--history-tokens", "32",
        "--question-tokens", "8", "--answer-tokens", "4", "--rate", "50"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from tests.serve_process import ServeProcess

    with ServeProcess(tiny_model_dir, "--max-num-seqs", "8") as s:
        yield s


def _bench(tmp_path, capsys, *argv: str) -> tuple[int, dict | None, str, str]:
    """Run ``kvlayer bench *argv --json`` ; (exit status, the record or None, stdout, stderr)."""
    out = tmp_path / "out.json"
    code = main(["bench", *argv, "--json", str(out)])
    printed = capsys.readouterr()
    return code, json.loads(out.read_text()) if out.exists() else None, printed.out, printed.err


def _one_line(err: str) -> str:
    """The one line of ``err`` (common.progress leaves a blank line on a stderr that is no terminal)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@needs_serve
def test_multi_round_qa_over_http_serves_every_turn_with_the_workloads_tokens(server, tiny_model_dir, tmp_path,
                                                                               capsys):
    png = tmp_path / "mrqa.png"
    code, rec, out, _ = _bench(tmp_path, capsys, "multi-round-qa", *MRQA, "--endpoint", server.url, "--model",
                               tiny_model_dir, "--label", "ours", "--plot", str(png))
    assert code == 0, out
    assert png.read_bytes()[:8] == PNG
    assert "multi-round-qa over HTTP" in out and "ours" in out
    assert rec["mode"] == "http" and rec["endpoint"] == server.url and rec["served_model"]
    assert "configs" not in rec["settings"] and rec["settings"]["label"] == "ours"
    [r] = rec["results"]
    assert (r["requests"], r["succeeded"], r["failed"], r["failures"]) == (6, 6, 0, [])
    assert r["warmup"]["requests"] == 3 and r["warmup"]["succeeded"] == 3
    assert r["ttft_s"]["mean"] > 0 and r["itl_s"]["mean"] > 0 and r["generated_tok_per_s"] > 0
    assert r["stand_in_answers"] == 0 and r["completion_tokens"] == 6 * 4
    assert 0 < r["cached_share"] <= 1
    rows = rec["requests"]["ours"]
    assert sorted((row["user"], row["turn"]) for row in rows) == [(u, t) for u in range(3) for t in (1, 2)]
    for row in rows:
        # the prompt holds every earlier question and the answer the server gave to it
        expected = 32 + 32 + (row["turn"] + 1) * 8 + row["turn"] * 4
        assert (row["status"], row["error"]) == (200, None)
        assert row["prompt_sent"] == row["prompt"] == expected
        assert row["output"] == row["output_ids"] == 4
        assert row["ttft_s"] > 0 and row["itl_mean_s"] > 0
        # every measured turn repeats its user's earlier prompt, served from the server's cache
        assert 0 < row["cached"] <= expected, row


@needs_serve
def test_long_doc_qa_over_http_reports_cached_repeated_documents(server, tmp_path, capsys):
    code, rec, out, _ = _bench(tmp_path, capsys, "long-doc-qa", "--docs", "2", "--doc-tokens", "64", "--queries", "2",
                               "--question-tokens", "8", "--answer-tokens", "2", "--endpoint", server.url,
                               "--vocab", "512")
    assert code == 0, out
    [r] = rec["results"]
    assert (r["requests"], r["succeeded"], r["failed"]) == (4, 4, 0)
    assert r["prompt_tokens"] == 4 * 72 and r["completion_tokens"] == 4 * 2
    assert r["ttft_s"]["mean"] > 0
    assert 0 < r["workload"]["repeat: cached"] <= 1
    rows = rec["requests"][server.url]
    assert [row["turn"] for row in rows] == [0, 1, 2, 3]
    assert all(row["status"] == 200 and row["output_ids"] == 2 for row in rows)
    assert rows[-1]["cached"] > 0  # the last query always repeats a document


@needs_serve
def test_every_request_failing_exits_2_with_the_status_and_message(server, tmp_path, capsys):
    code, rec, out, err = _bench(tmp_path, capsys, "multi-round-qa", *MRQA, "--endpoint", server.url,
                                 "--vocab", "512", "--served-model-name", "no-such-model")
    assert code == 2
    line = _one_line(err)
    assert line.startswith("kvlayer: error: all 6 measured requests failed, the first with HTTP 404: "), line
    [r] = rec["results"]
    assert (r["succeeded"], r["failed"]) == (0, 6)
    [failure] = r["failures"]
    assert failure["status"] == 404 and failure["count"] == 6 and failure["error"] in line
    assert f"failed: 6 x HTTP 404: {failure['error']}" in out


def test_a_refused_connection_is_one_line_and_exit_2(tmp_path, capsys):
    url = f"http://{HOST}:{free_port()}"
    code, rec, _, err = _bench(tmp_path, capsys, "multi-round-qa", *MRQA, "--endpoint", url, "--vocab", "512")
    assert code == 2 and rec is None
    assert _one_line(err) == f"kvlayer: error: cannot reach {url}/v1/models: Connection refused"


@pytest.mark.parametrize(("argv", "says"), [
    (["--endpoint", "localhost:8000"], "argument --endpoint: expected a URL starting http:// or https://"),
    (["--endpoint", "ftp://host"], "argument --endpoint: expected a URL starting http:// or https://"),
    (["--endpoint", "http://"], "argument --endpoint: expected a URL starting http:// or https://"),
    (["--vocab", "3"], "argument --vocab: must be >= 4"),
    (["--timeout", "0"], "argument --timeout: must be positive"),
    (["--endpoint", "http://127.0.0.1:1", "--vocab", "512", "--configs", "engine"],
     "--configs needs the in-process engine (not --endpoint)"),
    (["--endpoint", "http://127.0.0.1:1", "--vocab", "512", "--clock", "real"], "--clock needs the in-process"),
    (["--endpoint", "http://127.0.0.1:1"], "--endpoint needs --vocab or --model"),
    (["--vocab", "512"], "kvlayer: error: --vocab needs --endpoint"),
    (["--label", "x"], "kvlayer: error: --label needs --endpoint"),
])
def test_bad_http_flags_are_one_line_before_any_work(argv, says, tmp_path, capsys):
    code = main(["bench", "multi-round-qa", "--home", str(tmp_path / "home"), *argv])
    assert code == 2
    assert says in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "home").exists()  # no model made


# ----- the client against scripted streams (no server) -------------------------------------
def _events(*chunks: object, done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(c)}\n\n" for c in chunks] + (["data: [DONE]\n\n"] if done else [])
    return "".join(lines).encode()


def _usage(prompt: int, completion: int, cached: int | None) -> dict:
    details = {"prompt_tokens_details": {"cached_tokens": cached}} if cached is not None else {}
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion, **details}}


def _complete(handler) -> object:
    async def go():
        async with httpx.AsyncClient(base_url="http://test", transport=httpx.MockTransport(handler)) as client:
            return await stream_completion(client, {"prompt": [5, 6, 7], "max_tokens": 2})
    return asyncio.run(go())


class _CutStream(httpx.AsyncByteStream):
    async def __aiter__(self):
        yield _events({"choices": [{"text": "", "token_ids": [9]}]}, done=False)
        raise httpx.ReadError("connection reset by peer")


@pytest.mark.parametrize(("response", "status", "error"), [
    (httpx.Response(404, json={"error": {"message": "The model `x`\n does not exist."}}), 404,
     "The model `x` does not exist."),
    (httpx.Response(400, json={"detail": "bad prompt"}), 400, "bad prompt"),
    (httpx.Response(200, content=_events({"choices": [{"text": "a", "token_ids": [9]}]},
                                         {"error": {"message": "engine died"}})), 200, "engine died"),
    (httpx.Response(200, content=_events({"choices": [{"text": "a"}]}, done=False)), 200,
     "the stream ended before data: [DONE]"),
    (httpx.Response(200, stream=_CutStream()), 200, "ReadError: connection reset by peer"),
])
def test_a_failed_request_is_a_record_with_its_status_and_first_message(response, status, error):
    c = _complete(lambda request: response)
    assert not c.ok and (c.status, c.error) == (status, error)


def test_a_stream_is_timed_per_token_chunk_and_usage_counted():
    body = _events({"choices": [{"text": "", "token_ids": [], "prompt_token_ids": [5, 6, 7]}]},
                   {"choices": [{"text": "", "token_ids": [11]}]}, {"choices": [{"text": "", "token_ids": [12]}]},
                   _usage(3, 2, 1))
    seen = []
    c = _complete(lambda request: seen.append(json.loads(request.content)) or httpx.Response(200, content=body))
    assert c.ok and c.token_ids == (11, 12) and len(c.token_times) == 2  # the prompt-only chunk carries no token
    assert 0 < c.ttft <= c.token_times[1] <= c.end_s and len(c.inter_token_latencies) == 1
    assert (c.prompt_tokens, c.completion_tokens, c.cached_tokens) == (3, 2, 1)
    assert seen == [{"prompt": [5, 6, 7], "max_tokens": 2}]


def test_answers_without_token_ids_get_stand_ins_of_the_right_length():
    spec = MultiRoundSpec(users=2, rounds=2, system_tokens=4, history_tokens=4, question_tokens=2, answer_tokens=3)
    sessions = ChatSessions(spec, vocab=64)
    sent = []

    def handler(request):
        body = json.loads(request.content)
        sent.append(body)
        assert body["return_token_ids"] and body["stream"] and body["ignore_eos"] and body["temperature"] == 0
        text = [{"choices": [{"text": "x"}]}] * body["max_tokens"]
        return httpx.Response(200, content=_events(*text, _usage(len(body["prompt"]), body["max_tokens"], None)))

    async def go():
        async with httpx.AsyncClient(base_url="http://test", transport=httpx.MockTransport(handler)) as client:
            warm, turns = spec.turns(rate=float("inf"))
            return await run_phase(client, "m", turns, sessions, spec.answer_tokens, lambda n: None)

    records = asyncio.run(go())
    assert sorted(len(b["prompt"]) for b in sent) == [10, 10, 15, 15]  # the stand-in answer (3) joined the history
    summary = summarize_http("fake", records)
    assert summary["stand_in_answers"] == 4 and summary["succeeded"] == 4
    assert summary["cached_share"] is None and summary["cached_reported"] == 0
    assert summary["completion_tokens"] == 12 and summary["itl_s"]["mean"] >= 0
