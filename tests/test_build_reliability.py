"""Builds that lose nothing and refuse what cannot work; engine and checkpoint loads that say why.

* a build replaces ``--out`` atomically (private folder beside it, renames), so a killed or failed
  rebuild leaves the old engine loadable, and builds into one ``--out`` take turns (``<out>.lock``);
* a corrupt tokenizer, a ``--max-batch`` whose KV caches cannot fit, an edited manifest (its
  ``max_seq``, its ``tokenizer`` path) are refused with a clear error;
* unreadable paths (permission denied, a folder where a file should be, a file where a folder
  should be) are reported as such, naming the path.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import muse_spark.builder.build as builder
import muse_spark.engine_format as engine_format
from muse_spark.builder.build import BuildError, build_engine
from muse_spark.checkpoint import CheckpointError, TensorSource, load_pair
from muse_spark.runtime import EngineError, load_engine
from muse_spark.engine_format import cache_bytes

from conftest import run_cli

MAX_SEQ = 96


def build(pair, out, **kw):
    return build_engine(*pair, out, max_batch=kw.pop("max_batch", 2), max_seq=kw.pop("max_seq", MAX_SEQ), quiet=True,
                        **kw)


def leftovers(out: Path) -> list[str]:
    """What a build left beside ``out`` besides the engine and its lock file."""
    return sorted(p.name for p in out.parent.iterdir() if p.name not in (out.name, out.name + ".lock"))


def wait_for(predicate, timeout: float, what: str, proc=None):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the build ended (rc {proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture
def engine(agreeing_pair, tmp_path):
    """An engine at tmp_path/engines/tiny (alone in its folder)."""
    out = tmp_path / "engines" / "tiny"
    build(agreeing_pair, out)
    return out


def engine_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


# ---- atomic replacement ------------------------------------------------------------------------
# ``muse-spark build`` in a fresh process that holds the build, once its engine weights are written
# into its temporary folder, until the file argv[1] exists (forever if it never does).
HELD_BUILD = """
import sys, time
from pathlib import Path
import muse_spark.builder.build as be
save = be.save_canonical
def held(module, path):
    save(module, path)
    if Path(path).name == "draft.safetensors":
        while not Path(sys.argv[1]).exists():
            time.sleep(0.05)
be.save_canonical = held
from muse_spark.cli import main
sys.exit(main(sys.argv[2:]))
"""


def start_held_build(pair, out: Path, go: Path, *extra) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", HELD_BUILD, str(go), "build", "--target", str(pair[0]), "--draft", str(pair[1]),
         "--out", str(out), "--backend", "eager", "--device", "cpu", "--max-batch", "2", "--max-seq", str(MAX_SEQ),
         *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def temp_with_weights(out: Path) -> list[Path]:
    return list(out.parent.glob(f".{out.name}.building-*/draft.safetensors"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_rebuild_killed_mid_build_keeps_the_old_engine(agreeing_pair, engine, tmp_path, sig):
    before = engine_files(engine)
    proc = start_held_build(agreeing_pair, engine, tmp_path / "never")
    try:
        wait_for(lambda: temp_with_weights(engine), 300, "the build's temporary folder", proc)
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -sig, proc.stderr.read()[-3000:]
    # The old engine is in place, unchanged, and loads; nothing half-written sits where it is looked for.
    assert engine_files(engine) == before
    load_engine(engine)
    assert not engine.with_name(engine.name + ".partial").exists()
    if sig == signal.SIGTERM:  # (SIGTERM lets the build remove its temporary folder; SIGKILL cannot)
        assert leftovers(engine) == []
    else:
        assert [n.split("-")[0] for n in leftovers(engine)] == [f".{engine.name}.building"]
    # The next build cleans up what a killed one left, and replaces the engine.
    m = build(agreeing_pair, engine, max_batch=3)
    assert leftovers(engine) == []
    assert json.loads((engine / "manifest.json").read_text()) == m and load_engine(engine).max_batch == 3


def test_concurrent_builds_into_one_folder_take_turns(agreeing_pair, engine, tmp_path):
    go = tmp_path / "go"
    first = start_held_build(agreeing_pair, engine, go)  # holds the lock while its weights sit in its folder
    second = None
    try:
        wait_for(lambda: temp_with_weights(engine), 300, "the first build's temporary folder", first)
        err = tmp_path / "second.err"
        with open(err, "w") as f:
            second = subprocess.Popen(
                [sys.executable, "-m", "muse_spark.cli", "build", "--target", str(agreeing_pair[0]), "--draft",
                 str(agreeing_pair[1]), "--out", str(engine), "--max-batch", "3", "--max-seq", str(MAX_SEQ)],
                stdout=subprocess.DEVNULL, stderr=f, text=True)
        wait_for(lambda: "waiting for another build" in err.read_text(), 300, "the second build to wait", second)
        assert second.poll() is None and len(temp_with_weights(engine)) == 1
        go.touch()
        first.wait(timeout=120)
        second.wait(timeout=300)
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert first.returncode == 0, first.stderr.read()[-3000:]
    assert second.returncode == 0, err.read_text()[-3000:]
    assert f"holds {engine}.lock" in err.read_text()
    # The second build ran after the first: its engine is the one in place, whole.
    assert load_engine(engine).max_batch == 3
    assert leftovers(engine) == []


def test_a_failing_rebuild_leaves_the_old_engine(agreeing_pair, engine, monkeypatch):
    before = engine_files(engine)

    def full(module, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(builder, "save_canonical", full)
    with pytest.raises(BuildError, match=r"cannot write the engine .*tiny: .*target.safetensors: no space left"):
        build(agreeing_pair, engine)
    assert engine_files(engine) == before and leftovers(engine) == []
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # (the build's handler is gone again)


def test_an_engine_moved_aside_by_a_killed_swap_is_restored(agreeing_pair, engine, monkeypatch):
    """Killed between the swap's two renames: the old engine sits aside and --out is missing. The next
    build puts it back before anything else, so it survives that build failing too."""
    before = engine_files(engine)
    engine.rename(engine.with_name(f".{engine.name}.replaced-0123abcd"))

    def broken(*a, **kw):
        raise RuntimeError("the build broke")

    monkeypatch.setattr(builder, "_write_engine", broken)
    with pytest.raises(RuntimeError, match="the build broke"):
        build(agreeing_pair, engine)
    assert engine_files(engine) == before and leftovers(engine) == []
    load_engine(engine)


def test_the_refusals_about_out_still_hold(agreeing_pair, tmp_path):
    (tmp_path / "a-file").write_text("keep me")
    with pytest.raises(FileExistsError, match="exists and is not a directory"):
        build(agreeing_pair, tmp_path / "a-file")
    assert (tmp_path / "a-file").read_text() == "keep me"
    build(agreeing_pair, tmp_path / "e")
    with pytest.raises(FileExistsError, match="exists$"):
        build(agreeing_pair, tmp_path / "e", overwrite=False)
    (tmp_path / "link").symlink_to(tmp_path / "e")
    with pytest.raises(BuildError, match="is a symbolic link"):
        build(agreeing_pair, tmp_path / "link")
    load_engine(tmp_path / "e")
    empty = tmp_path / "empty"
    empty.mkdir()
    build(agreeing_pair, empty)  # (an empty folder is filled)
    load_engine(empty)


# ---- tokenizer ---------------------------------------------------------------------------------
def _pair_copy(agreeing_pair, tmp_path) -> tuple[Path, Path]:
    dst = tmp_path / "pair"
    for src in agreeing_pair:
        shutil.copytree(src, dst / src.name)
    return dst / "target", dst / "draft"


def test_a_corrupt_tokenizer_fails_the_build(agreeing_pair, tmp_path):
    pair = _pair_copy(agreeing_pair, tmp_path)
    text = (pair[0] / "tokenizer.json").read_text()
    (pair[0] / "tokenizer.json").write_text(text[: len(text) // 2])
    out = tmp_path / "engine"
    r = run_cli("build", "--target", pair[0], "--draft", pair[1], "--out", out, "--max-batch", 2, "--max-seq", MAX_SEQ)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"muse-spark: error: {pair[0] / 'tokenizer.json'}: not a readable tokenizer.json" in r.stderr
    assert not out.exists()


def test_a_tokenizer_beyond_the_vocabulary_fails_the_build(agreeing_pair, tmp_path):
    pair = _pair_copy(agreeing_pair, tmp_path)
    tok = json.loads((pair[0] / "tokenizer.json").read_text())
    tok["added_tokens"].append({**tok["added_tokens"][-1], "id": 259, "content": "<|extra|>"})
    (pair[0] / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(CheckpointError, match=r"token id 259, outside the target's vocabulary \[0, 259\)"):
        build(pair, tmp_path / "engine")


# ---- manifests ---------------------------------------------------------------------------------
def _edited(engine: Path, tmp_path: Path, **changes) -> Path:
    d = tmp_path / "edited"
    shutil.copytree(engine, d)
    m = json.loads((d / "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps({**m, **changes}))
    return d


@pytest.mark.parametrize("changes, message", [
    ({"max_seq": 10**6}, "manifest max_seq 1000000 exceeds the target's max_position_embeddings 1024"),
    ({"max_seq": 6}, r"manifest max_seq 6 is below γ\+2 = 7"),
    ({"max_seq": 96.5}, "manifest max_seq must be an integer, got 96.5"),
    ({"max_batch": 0}, "manifest max_batch must be >= 1, got 0"),
    ({"gamma": 4}, "manifest gamma 4 differs from the draft's block_size 5"),
    ({"tokenizer": "/etc/passwd"}, "tokenizer '/etc/passwd' points outside the engine directory"),
    ({"tokenizer": "../../../../../../etc/passwd"}, "points outside the engine directory"),
    ({"tokenizer": "notes.txt"}, "tokenizer 'notes.txt' is not among the manifest's hashed files"),
    ({"tokenizer": 7}, "tokenizer must be a file name inside the engine directory, got 7"),
])
def test_edited_manifests_are_refused(engine, tmp_path, changes, message):
    d = _edited(engine, tmp_path, **changes)
    with pytest.raises(EngineError, match=message):
        load_engine(d)


def test_an_engine_file_outside_the_engine_is_refused(engine, tmp_path):
    m = json.loads((engine / "manifest.json").read_text())
    d = _edited(engine, tmp_path, files={**m["files"], "../outside.bin": "0" * 64})
    with pytest.raises(EngineError, match="engine file '../outside.bin' points outside the engine directory"):
        load_engine(d)


def test_a_tokenizer_linked_outside_the_engine_is_refused(engine, tmp_path):
    """Even with its hash edited to match: the link resolves outside the engine."""
    secret = tmp_path / "secret.txt"
    secret.write_text("not for engines")
    d = tmp_path / "edited"
    shutil.copytree(engine, d)
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.json").symlink_to(secret)
    m = json.loads((d / "manifest.json").read_text())
    m["files"]["tokenizer.json"] = hashlib.sha256(secret.read_bytes()).hexdigest()
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match="'tokenizer.json' resolves outside the engine directory"):
        load_engine(d)


def test_the_tokenizer_is_hashed(engine, tmp_path):
    m = json.loads((engine / "manifest.json").read_text())
    assert m["tokenizer"] == "tokenizer.json" and "tokenizer.json" in m["files"]
    d = tmp_path / "edited"
    shutil.copytree(engine, d)
    (d / "tokenizer.json").write_text("{}")
    with pytest.raises(EngineError, match="engine file tokenizer.json does not match the manifest's hash"):
        load_engine(d)


def test_generate_reports_an_edited_max_seq(engine, tmp_path):
    d = _edited(engine, tmp_path, max_seq=4096)
    r = run_cli("generate", "--engine", d, "--prompt-ids", "1,2,3", "--max-tokens", 4)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "manifest max_seq 4096 exceeds the target's max_position_embeddings 1024" in r.stderr


# ---- memory ------------------------------------------------------------------------------------
def test_a_max_batch_beyond_memory_is_refused_at_build(agreeing_pair, tmp_path):
    r = run_cli("build", "--target", agreeing_pair[0], "--draft", agreeing_pair[1], "--out", tmp_path / "e",
                "--max-batch", 10**9, "--max-seq", 1024)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "muse-spark: error: --max-batch 1000000000 does not fit: the KV caches for max_batch 1000000000 × " \
           "max_seq 1024 need" in r.stderr
    assert "the largest max_batch that fits is" in r.stderr
    assert not (tmp_path / "e").exists()


def test_the_largest_max_batch_that_fits_is_named_and_builds(agreeing_pair, tmp_path, monkeypatch):
    target, draft = load_pair(*agreeing_pair)
    weights = sum(t.numel() * t.element_size() for m in (target, draft) for t in m.state_dict().values())
    per_slot = cache_bytes(target.cfg, draft.cfg, 1, MAX_SEQ, target.dtype)
    monkeypatch.setattr(builder, "device_memory", lambda device, available: weights + 5 * per_slot + per_slot // 2)
    with pytest.raises(BuildError, match="the largest max_batch that fits is 5"):
        build(agreeing_pair, tmp_path / "e", max_batch=6)
    assert not (tmp_path / "e").exists()
    build(agreeing_pair, tmp_path / "e", max_batch=5)
    # aoti engines allocate one slot more (for padded rows): the same memory holds max_batch 4 there.
    with pytest.raises(BuildError, match="the largest max_batch that fits is 4"):
        build_engine(*agreeing_pair, tmp_path / "a", backend="aoti", max_batch=5, max_seq=MAX_SEQ, quiet=True)
    monkeypatch.setattr(builder, "device_memory", lambda device, available: weights + per_slot // 2)
    with pytest.raises(BuildError, match="not even max_batch 1 fits: lower max_seq"):
        build(agreeing_pair, tmp_path / "e", max_batch=1)


def test_a_load_checks_the_caches_fit_before_allocating(engine, tmp_path, monkeypatch):
    d = _edited(engine, tmp_path, max_batch=10**9)
    with pytest.raises(EngineError, match=r"cannot load the engine: the KV caches for max_batch 1000000000 × max_seq "
                                          r"96 need .* the largest max_batch that fits is \d+"):
        load_engine(d)
    with pytest.raises(EngineError, match="max_batch 1000000000"):
        load_engine(engine, max_batch=10**9)
    m = json.loads((engine / "manifest.json").read_text())
    from muse_spark.engine_format import configs_from_manifest
    from muse_spark.config import parse_dtype

    tcfg, dcfg = configs_from_manifest(m)
    per_slot = cache_bytes(tcfg, dcfg, 1, MAX_SEQ, parse_dtype(m["dtype"]))
    monkeypatch.setattr(engine_format, "device_memory", lambda device, available: per_slot + 1)
    with pytest.raises(EngineError, match="the largest max_batch that fits is 1"):
        load_engine(engine)
    assert load_engine(engine, max_batch=1).max_batch == 1


# ---- unreadable paths --------------------------------------------------------------------------
def _call(fn) -> str:
    try:
        fn()
        return "OK"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def as_unprivileged(fn) -> str:
    """``fn()``'s outcome ("OK" or "Type: message") where file permissions apply: here unless this is
    root, for whom they do not; then in a forked child that drops to the nobody user."""
    if os.geteuid() != 0:
        return _call(fn)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        msg = "SKIP"
        try:
            signal.alarm(120)
            os.close(r)
            try:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            except OSError:
                msg = "SKIP"
            else:
                msg = _call(fn)
        finally:
            os.write(w, msg.encode())
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    if out == "SKIP":
        pytest.skip("cannot drop root privileges here")
    return out


@pytest.fixture(scope="module")
def shared_area(agreeing_pair):
    """A folder outside pytest's private tree (which only root may enter) with a copy of the pair and an
    engine, readable by all; the parent process has imported everything a build and a load need."""
    area = Path(tempfile.mkdtemp(prefix="muse-spark-perm-", dir="/tmp"))
    try:
        area.chmod(0o755)
        for src in agreeing_pair:
            shutil.copytree(src, area / src.name)
        build(agreeing_pair, area / "engine")
        load_engine(area / "engine")  # (the imports a load makes, before any fork)
        for p in [area, *area.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        yield area
    finally:
        shutil.rmtree(area, ignore_errors=True)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for p in [dst, *dst.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dst


def test_permission_denied_checkpoints_are_named(shared_area):
    target, draft = shared_area / "target", shared_area / "draft"
    closed = _copy(target, shared_area / "closed-target")
    closed.chmod(0o700)
    assert as_unprivileged(lambda: load_pair(closed, draft)) == \
        f"ValueError: cannot read {closed / 'config.json'}: permission denied"
    closed.chmod(0o711)  # (enterable, not listable)
    assert as_unprivileged(lambda: load_pair(closed, draft)) == \
        f"CheckpointError: cannot read checkpoint directory {closed}: permission denied"
    hidden = _copy(target, shared_area / "hidden-weights")
    (hidden / "model.safetensors").chmod(0o600)
    assert as_unprivileged(lambda: load_pair(hidden, draft)) == \
        f"CheckpointError: cannot read checkpoint file {hidden / 'model.safetensors'}: permission denied"
    tok = _copy(target, shared_area / "hidden-tokenizer")
    (tok / "tokenizer.json").chmod(0o600)
    out = shared_area / "open" / "engine"
    out.parent.mkdir(mode=0o777)
    out.parent.chmod(0o777)
    assert as_unprivileged(lambda: build((tok, draft), out)) == \
        f"CheckpointError: cannot read tokenizer {tok / 'tokenizer.json'}: permission denied"


def test_permission_denied_outputs_are_named(shared_area):
    target, draft = shared_area / "target", shared_area / "draft"
    closed = shared_area / "read-only"
    closed.mkdir(mode=0o755)
    assert as_unprivileged(lambda: build((target, draft), closed / "engine")) == \
        f"BuildError: cannot write beside --out: {closed / 'engine.lock'}: permission denied"
    assert as_unprivileged(lambda: build((target, draft), closed / "sub" / "engine")) == \
        f"BuildError: cannot create the folder of --out {closed / 'sub'}: permission denied"
    assert not any(closed.iterdir())


def test_permission_denied_engines_are_named(shared_area):
    e = _copy(shared_area / "engine", shared_area / "hidden-engine")
    (e / "draft.safetensors").chmod(0o600)
    assert as_unprivileged(lambda: load_engine(e)) == \
        f"EngineError: {e}: cannot read engine file {e / 'draft.safetensors'}: permission denied"
    (e / "manifest.json").chmod(0o600)
    assert as_unprivileged(lambda: load_engine(e)) == \
        f"EngineError: cannot read {e / 'manifest.json'}: permission denied"


# Root meets these too: a folder where a file should be, a file where a folder should be.
def test_a_folder_in_place_of_a_checkpoint_file(agreeing_pair, tmp_path):
    pair = _pair_copy(agreeing_pair, tmp_path)
    weights = pair[0] / "model.safetensors"
    weights.unlink()
    weights.mkdir()
    r = run_cli("build", "--target", pair[0], "--draft", pair[1], "--out", tmp_path / "e")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"muse-spark: error: cannot read checkpoint file {weights}: is a directory, expected a file" in r.stderr
    (pair[1] / "config.json").unlink()
    (pair[1] / "config.json").mkdir()
    with pytest.raises(ValueError, match=f"{pair[1] / 'config.json'}: is a directory, expected the config file"):
        load_pair(agreeing_pair[0], pair[1])


def test_a_folder_in_place_of_the_tokenizer(agreeing_pair, tmp_path):
    pair = _pair_copy(agreeing_pair, tmp_path)
    (pair[0] / "tokenizer.json").unlink()
    (pair[0] / "tokenizer.json").mkdir()
    with pytest.raises(CheckpointError, match="cannot read tokenizer .*tokenizer.json: is a directory"):
        build(pair, tmp_path / "e")


def test_a_file_in_place_of_a_folder(agreeing_pair, engine, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    with pytest.raises(BuildError, match=f"cannot create the folder of --out {blocker / 'sub'}: a component of the "
                                         f"path is not a directory \\({blocker} is a file, not a directory\\)"):
        build(agreeing_pair, blocker / "sub" / "engine")
    with pytest.raises(FileNotFoundError, match=f"no config.json at {blocker / 'draft'} "
                                                f"\\({blocker} is a file, not a directory\\)"):
        load_pair(agreeing_pair[0], blocker / "draft")
    with pytest.raises(CheckpointError, match=f"checkpoint directory {blocker / 'target'} does not exist "
                                              f"\\({blocker} is a file, not a directory\\)"):
        TensorSource(blocker / "target")
    with pytest.raises(EngineError, match=f"engine directory {blocker / 'e'} does not exist \\({blocker} is a file"):
        load_engine(blocker / "e")
    d = tmp_path / "copy"
    shutil.copytree(engine, d)
    (d / "target.safetensors").unlink()
    (d / "target.safetensors").mkdir()
    with pytest.raises(EngineError, match="engine file target.safetensors is not a regular file"):
        load_engine(d)
