"""The muse-spark command line, run as a user runs it (subprocesses)."""

import json
import subprocess
import sys

import pytest

from conftest import run_cli


cli = run_cli


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    r = cli("make-tiny", root / "pair", "--kind", "agreeing", "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert "built for acceptance" in r.stdout
    r = cli("build", "--target", root / "pair/target", "--draft", root / "pair/draft", "--out", root / "engine",
            "--backend", "eager", "--device", "cpu", "--max-batch", "2", "--max-seq", "128")
    assert r.returncode == 0, r.stderr
    assert "[build]" in r.stderr  # progress output
    return root


def test_generate_json_contract(tiny):
    r = cli("generate", "--engine", tiny / "engine", "--prompt-ids", "1,2,3", "--max-tokens", "17", "--ignore-eos",
            "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    ids = out["output_ids"]
    assert len(ids) == 17
    assert [ids[0]] + [t for s in out["steps"] for t in s["emitted"]] == ids
    for s in out["steps"]:
        assert len(s["draft_ids"]) == 5 and 0 <= s["accepted"] <= 5
        # emitted = accepted drafts + the bonus, clipped at max_tokens on the last step
        assert s["emitted"][: s["accepted"]] == s["draft_ids"][: min(s["accepted"], len(s["emitted"]))]
    assert isinstance(out["text"], str)
    assert out["stats"]["generated_tokens"] == 17


def test_generate_samples_and_stop_strings(tiny):
    """--n N: N samples (seeds seed, seed + 1, …), each the tokens its seed gives alone; --stop STR: the text
    ends just before the first stop string, the ids at the token that completed it."""
    def gen(*extra):
        r = cli("generate", "--engine", tiny / "engine", "--prompt", "Hello there", "--max-tokens", 24, "--json",
                "--ignore-eos", *extra)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])

    both = gen("--n", 3, "--temperature", 5, "--seed", 4)["samples"]
    assert len(both) == 3 and len({tuple(s["output_ids"]) for s in both}) > 1
    for i, sample in enumerate(both):
        assert sample["output_ids"] == gen("--temperature", 5, "--seed", 4 + i)["output_ids"]
    free = gen()
    stop = free["text"][6:9]
    assert len(stop) == 3 and free["text"].find(stop) == 6
    cut = gen("--stop", stop, "--stop", "never in this text")
    assert cut["text"] == free["text"][:6] and cut["finish_reason"] == "stop"
    assert cut["output_ids"] == free["output_ids"][:len(cut["output_ids"])] and len(cut["output_ids"]) < 24
    r = cli("generate", "--engine", tiny / "engine", "--prompt", "Hi", "--n", 2, "--stream")
    assert r.returncode == 2 and "--stream shows one sample" in r.stderr


def test_generate_from_checkpoints_matches_the_engine(tiny):
    a = cli("generate", "--engine", tiny / "engine", "--prompt", "Hello", "--max-tokens", "12", "--json",
            "--temperature", "0.8", "--seed", "9", "--ignore-eos")
    b = cli("generate", "--target", tiny / "pair/target", "--draft", tiny / "pair/draft", "--prompt", "Hello",
            "--max-tokens", "12", "--json", "--temperature", "0.8", "--seed", "9", "--ignore-eos")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    ja, jb = (json.loads(x.stdout.strip().splitlines()[-1]) for x in (a, b))
    assert ja["output_ids"] == jb["output_ids"] and ja["text"] == jb["text"]


def test_generate_stream_prints_acceptance(tiny):
    r = cli("generate", "--engine", tiny / "engine", "--prompt", "Hi", "--max-tokens", "20", "--stream",
            "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert "acceptance:" in r.stdout and "tokens/s" in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt-ids", "1,2,999"], "outside the vocabulary"),
        (["--prompt-ids", "1,x"], "comma-separated integers"),
        (["--prompt-ids", "1", "--max-tokens", "-1"], "max_tokens must be a positive integer"),
        (["--prompt-ids", "1", "--temperature", "nan"], "temperature must be a finite number"),
        (["--prompt-ids", "1", "--max-tokens", "500"], "exceeds the engine's maximum sequence length"),
        ([], "give exactly one of --prompt"),
    ],
)
def test_generate_bad_input_exits_with_a_message(tiny, args, message):
    r = cli("generate", "--engine", tiny / "engine", *args)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


def test_generate_with_a_missing_engine(tmp_path):
    r = cli("generate", "--engine", tmp_path / "nope", "--prompt-ids", "1")
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_make_tiny_rejects_unknown_kind(tmp_path):
    r = cli("make-tiny", tmp_path / "x", "--kind", "weird")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_build_engine_script_wraps_the_cli(tiny, tmp_path):
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "build_engine.py"
    r = subprocess.run([sys.executable, str(script), "--target", tiny / "pair/target", "--draft",
                        tiny / "pair/draft", "--out", tmp_path / "e", "--max-seq", "64"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "e" / "manifest.json").is_file()
    bad = subprocess.run([sys.executable, str(script), "--target", tmp_path / "missing", "--draft",
                          tiny / "pair/draft", "--out", tmp_path / "e2"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "no config.json" in bad.stderr


@pytest.mark.parametrize("args, message", [
    (("--backend", "aoti", "--device", "cpu", "--plugins", "triton"), "needs --device cuda"),
    (("--backend", "eager", "--plugins", "inline"), "apply to --backend aoti only"),
    (("--backend", "eager", "--prefill-batch", "2"), "--prefill-batch applies to --backend aoti"),
    (("--backend", "aoti", "--device", "cpu", "--max-batch", "2", "--prefill-batch", "3"),
     "prefill batch 3 must be an integer in [1, max_batch=2]"),
    (("--backend", "aoti", "--device", "cpu", "--prefill-batch", "0"), "expected a positive integer"),
])
def test_build_plugins_option_is_checked_before_compiling(tiny, tmp_path, args, message):
    r = cli("build", "--target", tiny / "pair/target", "--draft", tiny / "pair/draft", "--out", tmp_path / "e",
            *args, timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "e" / "manifest.json").exists()
