"""The Python API and the CLI's input: clear errors, and no work silently dropped or corrupted.

``Generator.generate`` checks all its requests before it queues any; a ``Generator`` shared by threads
gives every request exactly its single-threaded tokens; ``muse-spark generate`` refuses prompts it
cannot read exactly; path and permission errors end in one ``muse-spark: error:`` line, no traceback.
"""

import errno
import subprocess
import sys
import threading
import time

import pytest

from conftest import run_cli
from muse_spark import cli
from muse_spark.runtime import Generator, Request, RequestError, SamplingParams

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def untouched(gen: Generator) -> bool:
    return not gen.has_work() and sorted(gen.free_slots) == list(range(gen.engine.max_batch))


# ---- generate(): params lists and all-or-nothing ----------------------------------------------
@pytest.mark.parametrize("n_params", [1, 2, 4])
def test_a_params_list_of_another_length_is_refused(agreeing_engine, n_params):
    gen = Generator(agreeing_engine)
    with pytest.raises(RequestError, match=f"{n_params} SamplingParams for 3 prompts"):
        gen.generate([[1, 2], [3, 4], [5, 6]], [GREEDY] * n_params)
    assert untouched(gen)


def test_a_params_list_or_tuple_of_the_same_length_gives_each_prompt_its_params(agreeing_engine):
    gen = Generator(agreeing_engine)
    params = (SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=7, ignore_eos=True))
    reqs = gen.generate([[1, 2], [3, 4]], params)
    assert [len(r.output) for r in reqs] == [3, 7]
    reqs = gen.generate([[1, 2], [3, 4]], list(params))
    assert [len(r.output) for r in reqs] == [3, 7] and untouched(gen)


@pytest.mark.parametrize("prompts, params, message", [
    ([[1, 2], [1, 10**6], [3]], GREEDY, r"prompt 1 of 3: prompt token ids \[1000000\] are outside the vocabulary"),
    ([[1, 2], [3], []], GREEDY, "prompt 2 of 3: the prompt is empty"),
    ([[1, 2], [3, 4]], [GREEDY, SamplingParams(max_tokens=0)], "prompt 1 of 2: max_tokens must be a positive"),
    ([[1, 2], ["a"]], GREEDY, "prompt 1 of 2: prompt token ids must be integers, got str 'a'"),
    ([[1, 2], 7], GREEDY, "prompt 1 of 2: a prompt must be a list of token ids, got int"),
    ([1, 2, 3], GREEDY, "got a list of integers: for one prompt, pass \\[prompt\\]"),
    ([[1, 2]], [{"max_tokens": 3}], "params must be a SamplingParams, got dict"),
])
def test_one_bad_request_queues_none_of_them(agreeing_engine, prompts, params, message):
    """Every request is checked before any is queued: after the error the generator is as it was,
    and the valid prompts do not run in a later call."""
    gen = Generator(agreeing_engine)
    running = gen.add([9, 8, 7], GREEDY)
    gen.step()
    before = (list(gen.waiting), list(gen.active), list(gen.free_slots))
    with pytest.raises(RequestError, match=message):
        gen.generate(prompts, params)
    assert (list(gen.waiting), list(gen.active), list(gen.free_slots)) == before
    later = gen.generate([[4, 5]], GREEDY)
    assert len(later) == 1 and later[0].id == running.id + 1  # (no request ids spent on the refused call)
    gen.run()
    assert running.finished and untouched(gen)


def test_cancel_with_a_reason_and_requests_ended_before_they_ran(agreeing_engine):
    gen = Generator(agreeing_engine)
    running, waiting = gen.add([1, 2], GREEDY), gen.add([3, 4], GREEDY)
    gen.step()  # admits both
    queued = gen.add([5, 6], GREEDY)
    gen.cancel(running, "shutdown")
    gen.cancel(queued, "shutdown")
    gen.cancel(waiting)
    assert [r.finish_reason for r in (running, queued, waiting)] == ["shutdown", "shutdown", "cancelled"]
    assert len(running.output) == 1 and queued.output == [] and untouched(gen)
    gen.cancel(running, "other")  # (a finished request stays as it is)
    assert running.finish_reason == "shutdown"
    ended = Request.ended([1, 2], GREEDY, "shutdown")
    assert ended.finished and ended.finish_reason == "shutdown" and ended.output == [] and ended.prompt == [1, 2]
    assert ended.stats(agreeing_engine.gamma)["generated_tokens"] == 0


# ---- one Generator, several threads ------------------------------------------------------------
THREADS, PER_THREAD, ROUNDS = 4, 2, 3


def _single_threaded(engine, prompts, params=GREEDY):
    return {tuple(p): Generator(engine).generate([p], params)[0].output for p in prompts}


def _in_threads(work, n, timeout=180.0):
    """Run ``work(k)`` in n threads started together → the exceptions they raised. A thread still
    running after ``timeout`` seconds (a scheduler spinning forever) fails the test."""
    barrier, errors = threading.Barrier(n), []

    def body(k):
        try:
            barrier.wait()
            work(k)
        except BaseException as e:  # noqa: BLE001 (reported by the test)
            errors.append(e)

    threads = [threading.Thread(target=body, args=(k,), daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.0))
    assert not any(t.is_alive() for t in threads), f"a thread is still running after {timeout:.0f} s"
    return errors


def test_threads_sharing_a_generator_each_get_their_single_threaded_tokens(agreeing_engine):
    prompts = [[3 * i + 1, 3 * i + 2, 3 * i + 3] for i in range(THREADS * PER_THREAD)]
    expected = _single_threaded(agreeing_engine, prompts)
    gen = Generator(agreeing_engine)
    for _ in range(ROUNDS):
        results = {}

        def work(k):
            mine = prompts[k * PER_THREAD:(k + 1) * PER_THREAD]
            reqs = gen.generate(mine, GREEDY)
            results[k] = [(tuple(r.prompt), r.output, r.finish_reason) for r in reqs]

        assert _in_threads(work, THREADS) == []
        got = [x for k in range(THREADS) for x in results[k]]
        assert [p for p, _, _ in got] == [tuple(p) for p in prompts]
        wrong = [p for p, out, _ in got if out != expected[p]]
        assert wrong == [], f"{len(wrong)}/{len(got)} requests got other tokens than alone"
        assert all(reason == "length" for _, _, reason in got)
        assert untouched(gen)


def test_threads_streaming_and_generating_on_one_generator(agreeing_engine):
    """Streams (the lock per step, released at each yield) and generate() calls in threads at once;
    one stream is closed early and frees its slot."""
    prompts = [[50 + i, 60 + i] for i in range(THREADS)]
    expected = _single_threaded(agreeing_engine, prompts)
    gen = Generator(agreeing_engine)
    results = {}

    def work(k):
        if k % 2:
            results[k] = gen.generate([prompts[k]], GREEDY)[0].output
        else:
            results[k] = sum(gen.stream(prompts[k], GREEDY), [])
            it = gen.stream([7, 7], GREEDY)
            next(it)
            it.close()  # cancels it

    assert _in_threads(work, THREADS) == []
    assert [results[k] for k in range(THREADS)] == [expected[tuple(p)] for p in prompts]
    assert untouched(gen)


def test_iterating_a_request_of_another_generator_raises(agreeing_engine):
    req = Generator(agreeing_engine).add([1, 2], GREEDY)
    gen = Generator(agreeing_engine)
    errors = _in_threads(lambda k: list(gen.iter_request(req)), 1, timeout=60)
    assert len(errors) == 1 and isinstance(errors[0], RequestError), errors
    assert "not queued in this Generator" in str(errors[0])


# ---- muse-spark generate: prompts ---------------------------------------------------------------
@pytest.mark.parametrize("text, ids", [("1,2,3", [1, 2, 3]), (" 1, 2 ,3 ", [1, 2, 3]), ("0", [0]), ("007", [7]),
                                       ("1,\t2", [1, 2])])
def test_prompt_ids_accepts_ascii_decimal_lists(text, ids):
    assert cli._parse_ids(text) == ids


@pytest.mark.parametrize("text, message", [
    ("١٢", "ASCII digits 0-9"),  # Arabic-Indic digits: int() would take them
    ("1,２", "ASCII digits 0-9"),  # full-width
    ("1_000", "ASCII digits 0-9"),
    ("+1", "ASCII digits 0-9"),
    ("1 2", "ASCII digits 0-9"),
    ("0x10", "ASCII digits 0-9"),
    ("1,x", "comma-separated integers"),
    ("-1", "token ids are integers >= 0, got -1"),
    ("1,,2", "empty entry"),
    ("1,2,", "empty entry"),
    (",1", "empty entry"),
    ("", "--prompt-ids is empty"),
    ("  ", "--prompt-ids is empty"),
    ("9" * 5000, "(5000 digits) is outside the vocabulary"),  # (int() refuses 4300+ digits with its own error)
])
def test_prompt_ids_refuses_anything_else(text, message):
    with pytest.raises(ValueError) as e:
        cli._parse_ids(text)
    assert message in str(e.value)


@pytest.fixture(scope="module")
def engine_dir(agreeing_pair, tmp_path_factory):
    from muse_spark.builder.build import build_engine

    out = tmp_path_factory.mktemp("reliability") / "engine"
    build_engine(*agreeing_pair, out, max_batch=2, max_seq=96, quiet=True)
    return out


def _cli_bytes(*args):
    """The CLI with raw bytes arguments (as a shell passes text that is not UTF-8)."""
    argv = [a if isinstance(a, bytes) else str(a).encode() for a in args]
    return subprocess.run([sys.executable.encode(), b"-m", b"muse_spark.cli", *argv], capture_output=True,
                          timeout=300)


def test_a_prompt_that_is_not_utf8_gets_a_clear_error(engine_dir):
    r = _cli_bytes("generate", "--engine", engine_dir, "--prompt", b"ab\xff", "--max-tokens", "3")
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 2, err
    assert "muse-spark: error: --prompt is not valid UTF-8 text (byte 0xff at character 2)" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("ids, message", [
    ("١٢", "ASCII digits 0-9"),
    ("-3", "token ids are integers >= 0"),
    ("1,,2", "empty entry"),
    ("1,259", r"outside the vocabulary [0, 259)"),
])
def test_generate_prompt_ids_errors(engine_dir, ids, message):
    r = run_cli("generate", "--engine", engine_dir, f"--prompt-ids={ids}", "--max-tokens", "3")
    assert r.returncode == 2, r.stderr
    assert "muse-spark: error:" in r.stderr and message in r.stderr and "Traceback" not in r.stderr


# ---- muse-spark: OS errors -----------------------------------------------------------------------
def _clean_error(r, *parts):
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("muse-spark: error:") and all(p in last for p in parts), last


def test_an_output_folder_below_a_file(agreeing_pair, tmp_path):
    (tmp_path / "file").write_text("x")
    r = run_cli("build", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--out", tmp_path / "file" / "e",
                "--max-batch", 1, "--max-seq", 64)
    _clean_error(r, str(tmp_path / "file"))
    r = run_cli("make-tiny", tmp_path / "file" / "pair")
    _clean_error(r, str(tmp_path / "file"), "not a directory")


def test_a_folder_in_place_of_a_file(tmp_path):
    (tmp_path / "pair" / "target" / "config.json").mkdir(parents=True)
    r = run_cli("make-tiny", tmp_path / "pair")
    _clean_error(r, "config.json")


def test_engine_and_checkpoint_paths_that_are_missing_or_below_a_file(engine_dir, agreeing_pair, tmp_path):
    (tmp_path / "file").write_text("x")
    for args in (["--engine", tmp_path / "file" / "engine"], ["--engine", tmp_path / "missing"],
                 ["--target", tmp_path / "file" / "t", "--draft", agreeing_pair[1]],
                 ["--target", agreeing_pair[0], "--draft", tmp_path / "missing"]):
        _clean_error(run_cli("generate", *args, "--prompt-ids", "1", "--max-tokens", 2), str(tmp_path))


@pytest.mark.parametrize("exc, message", [
    (PermissionError(errno.EACCES, "Permission denied", "/srv/engines/x/target.safetensors"),
     "muse-spark: error: /srv/engines/x/target.safetensors: permission denied"),
    (IsADirectoryError(errno.EISDIR, "Is a directory", "/srv/engines/x/manifest.json"),
     "muse-spark: error: /srv/engines/x/manifest.json: is a directory"),
    (NotADirectoryError(errno.ENOTDIR, "Not a directory", "/srv/file/x"),
     "muse-spark: error: /srv/file/x: not a directory (a part of the path is a file)"),
    (FileNotFoundError("engine directory /srv/nope does not exist"),
     "muse-spark: error: engine directory /srv/nope does not exist"),
    (OSError(errno.ENOSPC, "No space left on device"), "muse-spark: error: [Errno 28] No space left on device"),
    (type("LayoutError", (ValueError,), {})("/srv/t: the checkpoint's shapes do not match its config"),
     "muse-spark: error: /srv/t: the checkpoint's shapes do not match its config"),
])
def test_os_and_value_errors_of_loading_end_in_one_line(monkeypatch, capsys, exc, message):
    """Permission denied is what root never sees from chmod: the loader raises it here."""
    import muse_spark.runtime as runtime

    def load_engine(*a, **k):
        raise exc

    monkeypatch.setattr(runtime, "load_engine", load_engine)
    assert cli.main(["generate", "--engine", "/srv/engines/x", "--prompt-ids", "1"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == message and "Traceback" not in err


def test_errors_of_building_end_in_one_line(monkeypatch, capsys):
    import muse_spark.builder.build as builder

    class BuildCheckError(ValueError):
        pass

    def refuse(*a, **k):
        raise BuildCheckError("--max-seq 100000 exceeds the target's 4096 positions")

    monkeypatch.setattr(builder, "build_engine", refuse)
    assert cli.main(["build", "--target", "t", "--draft", "d", "--out", "o"]) == 2
    assert capsys.readouterr().err.strip() == "muse-spark: error: --max-seq 100000 exceeds the target's 4096 positions"

    def denied(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", "o.partial")

    monkeypatch.setattr(builder, "build_engine", denied)
    assert cli.main(["build", "--target", "t", "--draft", "d", "--out", "o"]) == 2
    assert capsys.readouterr().err.strip() == "muse-spark: error: o.partial: permission denied"


def test_a_tokenizer_file_that_is_not_one_raises_an_engine_error(tmp_path):
    from muse_spark.runtime import EngineError, load_tokenizer

    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(EngineError, match="tokenizer.json: not a readable tokenizer.json"):
        load_tokenizer(tmp_path / "tokenizer.json")
    assert load_tokenizer(tmp_path / "missing.json") is None
