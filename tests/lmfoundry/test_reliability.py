"""Issue 16, quantize/inspect/model-cache part: user mistakes and hostile inputs are one `error:`
line and a non-zero exit, never a traceback, a hang, a read outside the artifact, or lost data.

Every test here except the one marked "guard" failed (or hung, or lost files) on the code
before the fix (commit 2ce45e7); "after" is what the test asserts now. Hang-prone cases run the CLI in a subprocess with a timeout and a
memory limit, so the old behaviour fails the test instead of stalling or exhausting the machine.

| # | case | before | after | test |
|---|------|--------|-------|------|
| 3 | `quantize -o DIR --overwrite`, DIR holds someone's files | DIR deleted, replaced by the checkpoint | exit 2, one line, files intact, nothing left beside DIR | test_overwrite_refuses_a_folder_that_is_not_an_artifact |
| 3 | `--overwrite` onto an artifact holding an extra notes.txt | notes.txt deleted | exit 2, one line naming it, nothing deleted | test_overwrite_refuses_an_artifact_holding_foreign_files |
| 3 | `--overwrite` onto our artifact / an empty folder (guard) | replaced | still replaced, shards byte-identical to a fresh run, no hidden leftovers | test_overwrite_replaces_an_artifact_and_an_empty_folder |
| 3 | run fails mid-pipeline, `-o new/a/b/out` (and `--overwrite` of an artifact) | new/a/b left behind | nothing created is left; the old artifact is intact | test_failed_run_leaves_nothing_behind |
| 4 | `--allow-pickle`: .bin replaced at the same path | stale conversion silently reused | converted again (cache keyed by content) | test_pickle_cache_follows_content |
| 4 | two processes convert one GGUF at once | one crashes in the shared temp folder | both exit 0, one conversion, same folder, no temp left | test_two_processes_convert_one_gguf |
| 4 | same for a pickle folder, with the file lock disabled | one crashes | the rename loser uses the winner's folder | test_two_processes_convert_one_pickle_folder_without_the_lock |
| 6 | manifest lists `/dev/zero`, `../x`, `/etc/hostname`, a symlink out, a FIFO | inspect hangs or hashes files outside | FAILED lines ("outside the folder", "not a regular file"), exit 1, fast | test_inspect_keeps_manifest_paths_inside_the_artifact |
| 6 | lmfoundry.json is a symlink to /dev/zero, or a FIFO | reads until out of memory / blocks | one line, exit 2 | test_inspect_refuses_a_manifest_that_is_not_a_regular_file |
| 6 | safetensors index names `../other/model.safetensors` | quantizes weights from outside the folder | one line, exit 2 | test_index_pointing_outside_the_model_folder_is_refused |
| 8 | manifest is a list, a string, nested 100000 deep, not UTF-8 | AttributeError / RecursionError / UnicodeDecodeError traceback | one line, exit 2 | test_inspect_malformed_manifest_is_one_line |
| 8 | manifest fields of the wrong type | TypeError/AttributeError traceback | summary with "?"/n/a, exit 0 | test_inspect_tolerates_wrong_field_types |
| 8 | recipe values of the wrong type (11 variants) | traceback, or silently used (`per_channel: "no"` is truthy) | one line naming the key, exit 2 | test_recipe_value_of_wrong_type |
| 8 | `doctor` with a recipe value of the wrong type, `--ctx 1e5`, `--seed 1e23` | traceback / click usage block | one line, exit 2 | test_doctor_recipe_value_of_wrong_type |
| 8 | `--seed 1e23`, `--seed 10**23`, `--seed -1`, `--num-samples 1.5`, `--group-size 0` | click usage block / ValueError traceback / accepted | one line, exit 2 | test_integer_flags_out_of_range |
| 8 | output folder not writable (sysfs, parent is a file, chmod 555 - skipped as root) | traceback after the whole run | one line before any model work, nothing created | test_unwritable_output_is_one_line |
| 8 | `--calib` chat record without a role / not an object | silently rendered / TypeError traceback | one line with file:line, exit 2 | test_calib_chat_record_without_role |
| 8 | `--calib /dev/zero`, a FIFO | reads until out of memory / blocks | one line, exit 2 | test_calib_device_or_fifo_is_refused |
| 8 | MODEL is a FIFO, or a .gguf symlink to /dev/zero | blocks / reads until out of memory | one line, exit 2 | test_model_path_that_is_a_device_or_fifo |
| 8 | `--calib` file of NUL bytes | calibrates on NULs, exit 0 | one line, exit 2 | test_calib_binary_junk_is_refused |

Lower-level calibration cases (bounded reads, template errors) are in
tests/calibration/test_data_reliability.py.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import assert_one_error, run_cli, tiny_model_folder

QUANT = ["--quiet", "--scheme", "w4a16", "--group-size", "32", "--num-samples", "2", "--seq-len", "16"]


def _limit_memory() -> None:
    """Child processes get 3 GiB of address space: old code reading /dev/zero dies quickly."""
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def run_sub(args: list[str], timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """The CLI in a child process with a timeout and a memory limit (for hang-prone inputs)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, "-m", "lmfoundry.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, preexec_fn=_limit_memory)


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def copy_artifact(artifact: Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    for f in artifact.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


# ------------------------------------------------------------------------------- 3: --overwrite
def test_overwrite_refuses_a_folder_that_is_not_an_artifact(model, calib, tmp_path, capsys):
    victim = tmp_path / "thesis"
    (victim / "chapters").mkdir(parents=True)
    (victim / "draft.tex").write_text("three years of work")
    (victim / "chapters" / "1.tex").write_text("intro")
    code, _, err = run_cli(["quantize", str(model), "-o", str(victim), *QUANT, "--calib", str(calib),
                            "--overwrite"], capsys)
    assert_one_error(code, err, "not an lmfoundry artifact", "nothing was deleted")
    assert (victim / "draft.tex").read_text() == "three years of work"
    assert (victim / "chapters" / "1.tex").read_text() == "intro"
    assert listing(tmp_path) == ["thesis"]


def test_overwrite_refuses_an_artifact_holding_foreign_files(artifact, model, calib, tmp_path, capsys):
    out = copy_artifact(artifact, tmp_path / "q")
    (out / "notes.txt").write_text("my eval notes")
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    code, _, err = run_cli(["quantize", str(model), "-o", str(out), *QUANT, "--calib", str(calib),
                            "--overwrite"], capsys)
    assert_one_error(code, err, "notes.txt", "nothing was deleted")
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert listing(tmp_path) == ["q"]


def test_overwrite_replaces_an_artifact_and_an_empty_folder(artifact, model, calib, tmp_path, capsys):
    """The allowed cases still work, and the checkpoint is the same bytes as a fresh run."""
    out = copy_artifact(artifact, tmp_path / "q")
    (tmp_path / "empty").mkdir()
    for target in (out, tmp_path / "empty"):
        code, stdout, err = run_cli(["quantize", str(model), "-o", str(target), *QUANT, "--calib", str(calib),
                                     "--overwrite"], capsys)
        assert code == 0, err
        assert "wrote" in stdout
        for shard in sorted(artifact.glob("*.safetensors")):
            assert (target / shard.name).read_bytes() == shard.read_bytes()
    assert listing(tmp_path) == ["empty", "q"]  # no .q.new-* / .q.old-* left
    code, _, err = run_cli(["inspect", str(out)], capsys)
    assert code == 0, err


def test_failed_run_leaves_nothing_behind(artifact, model, calib, tmp_path, capsys, monkeypatch):
    """A failure after shards were written: the parents created for -o are removed again and an
    artifact being replaced is untouched."""
    from lmfoundry.calibration import pipeline
    from lmfoundry.errors import UserError

    def failing(reader, plan, quantizer, calib_ids, out_dtype, options, writer, journal=None):
        writer.write_shard("model-00001-of-00009.safetensors", {"x": __import__("torch").zeros(4)})
        raise UserError("simulated failure after the first shard")

    monkeypatch.setattr(pipeline, "run_pipeline", failing)
    nested = tmp_path / "new" / "a" / "b" / "out"
    code, _, err = run_cli(["quantize", str(model), "-o", str(nested), *QUANT, "--calib", str(calib)], capsys)
    assert_one_error(code, err, "simulated failure")
    assert listing(tmp_path) == []

    out = copy_artifact(artifact, tmp_path / "q")
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    code, _, err = run_cli(["quantize", str(model), "-o", str(out), *QUANT, "--calib", str(calib),
                            "--overwrite"], capsys)
    assert_one_error(code, err, "simulated failure")
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert listing(tmp_path) == ["q"]


# ------------------------------------------------------------------------ 4: conversion cache
def _pickle_folder(model: Path, dest: Path, seed: int) -> Path:
    """A model folder whose weights are a pickle (pytorch_model.bin) of a tiny random model."""
    import torch
    from safetensors.torch import load_file

    fresh = tiny_model_folder(dest.parent / f"{dest.name}-src{seed}", "llama", seed=seed)
    dest.mkdir(exist_ok=True)
    for f in model.iterdir():
        if f.suffix != ".safetensors":
            (dest / f.name).write_bytes(f.read_bytes())
    torch.save(load_file(str(fresh / "model.safetensors")), dest / "pytorch_model.bin")
    return dest


def test_pickle_cache_follows_content(model, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from lmfoundry.checkpoint.sources import resolve_model

    monkeypatch.setenv("LMFOUNDRY_CACHE", str(tmp_path / "cache"))
    src = _pickle_folder(model, tmp_path / "pickled", seed=1)
    first = resolve_model(src, allow_pickle=True)
    w1 = load_file(str(first / "model.safetensors"))["model.embed_tokens.weight"]
    assert resolve_model(src, allow_pickle=True) == first  # unchanged input: reused
    _pickle_folder(model, src, seed=2)  # new weights, same path
    second = resolve_model(src, allow_pickle=True)
    w2 = load_file(str(second / "model.safetensors"))["model.embed_tokens.weight"]
    fresh = load_file(str(tmp_path / "pickled-src2" / "model.safetensors"))["model.embed_tokens.weight"]
    assert second != first and not w2.equal(w1) and w2.equal(fresh)
    umask = os.umask(0)
    os.umask(umask)
    assert second.stat().st_mode & 0o777 == 0o777 & ~umask  # a cache entry others may read, as before


def write_tiny_gguf(path: Path, seed: int = 0, hidden: int = 64, inter: int = 128, heads: int = 4,
                    kv_heads: int = 2) -> Path:
    """A one-layer random Llama GGUF with a byte-level BPE vocabulary that transformers loads."""
    import gguf
    import numpy as np

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):  # GPT-2's bytes_to_unicode alphabet
        if b not in printable:
            chars.append(256 + extra)
            extra += 1
    tokens = ["<s>", "</s>", *[chr(c) for c in chars], "Ġt"]
    rng = np.random.default_rng(seed)

    def rand(*shape: int):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(1)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    kv = kv_heads * hidden // heads
    w.add_tensor("token_embd.weight", rand(len(tokens), hidden))
    for name, shape in [("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                        ("attn_output", (hidden, hidden)), ("ffn_gate", (inter, hidden)),
                        ("ffn_up", (inter, hidden)), ("ffn_down", (hidden, inter))]:
        w.add_tensor(f"blk.0.{name}.weight", rand(*shape))
    for name in ("blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"):
        w.add_tensor(f"{name}.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", rand(len(tokens), hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Each child imports everything, signals ready, waits for "go", then converts with save_file slowed
# down, so both conversions overlap for certain (the old code's shared temp folder then breaks).
CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import safetensors.torch, transformers, torch
    import lmfoundry.checkpoint.sources as models
    real_save = safetensors.torch.save_file
    def slow_save(*a, **k):
        time.sleep(1.5)
        return real_save(*a, **k)
    safetensors.torch.save_file = slow_save
    if sys.argv[3] == "nolock" and hasattr(models, "_conversion_lock"):
        import contextlib
        models._conversion_lock = lambda target: contextlib.nullcontext()
    sync = Path(sys.argv[2])
    (sync / ("ready-" + sys.argv[4])).touch()
    deadline = time.time() + 120
    while not (sync / "go").exists() and time.time() < deadline:
        time.sleep(0.02)
    print(models.resolve_model(sys.argv[1], allow_pickle=True))
""")


def convert_concurrently(spec: Path, tmp_path: Path, lock: bool) -> list[subprocess.CompletedProcess]:
    sync = tmp_path / "sync"
    sync.mkdir()
    env = {**os.environ, "LMFOUNDRY_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(spec), str(sync), "lock" if lock else "nolock",
                               str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              preexec_fn=_limit_memory) for i in range(2)]
    try:
        import time

        deadline = time.time() + 120
        while len(list(sync.glob("ready-*"))) < 2 and time.time() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.05)
        (sync / "go").touch()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=180)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def assert_one_conversion(results: list[subprocess.CompletedProcess], cache: Path) -> Path:
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    folders = {r.stdout.strip().splitlines()[-1] for r in results}
    assert len(folders) == 1, folders
    folder = Path(folders.pop())
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    models = cache / "models"
    leftovers = [p.name for p in models.iterdir() if p != folder and not p.name.endswith(".lock")]
    assert leftovers == [], leftovers
    return folder


def test_two_processes_convert_one_gguf(tmp_path):
    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf")
    results = convert_concurrently(gguf_file, tmp_path, lock=True)
    folder = assert_one_conversion(results, tmp_path / "cache")
    assert sum("converting tiny.gguf" in r.stderr for r in results) == 1  # the work ran once
    from lmfoundry.model.config import ModelConfig

    assert ModelConfig.from_file(folder).num_layers == 1


def test_two_processes_convert_one_pickle_folder_without_the_lock(model, tmp_path):
    src = _pickle_folder(model, tmp_path / "pickled", seed=3)
    results = convert_concurrently(src, tmp_path, lock=False)
    folder = assert_one_conversion(results, tmp_path / "cache")
    from safetensors.torch import load_file

    got = load_file(str(folder / "model.safetensors"))
    want = load_file(str(tmp_path / "pickled-src3" / "model.safetensors"))
    assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want)


# ---------------------------------------------------------------- 6: paths named by artifacts
def _with_files(artifact: Path, dest: Path, extra: dict[str, str]) -> Path:
    out = copy_artifact(artifact, dest)
    manifest = json.loads((out / "lmfoundry.json").read_text())
    manifest["files"].update(extra)
    (out / "lmfoundry.json").write_text(json.dumps(manifest))
    return out


def test_inspect_keeps_manifest_paths_inside_the_artifact(artifact, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    os.mkfifo(tmp_path / "outside.fifo")
    out = _with_files(artifact, tmp_path / "q", {
        "/dev/zero": "0" * 64,
        "../secret.txt": "0" * 64,
        "../outside.fifo": "0" * 64,
        "/etc/hostname": "0" * 64,
        "zero-link": "0" * 64,
        "secret-link": "0" * 64,
        "pipe": "0" * 64,
    })
    os.symlink("/dev/zero", out / "zero-link")
    os.symlink(secret, out / "secret-link")
    os.mkfifo(out / "pipe")
    proc = run_sub(["inspect", str(out)], timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    failed = {ln.split(":")[0].removeprefix("FAILED "): ln for ln in proc.stderr.splitlines() if ln.startswith("FAILED")}
    for rel in ("/dev/zero", "../secret.txt", "../outside.fifo", "/etc/hostname"):
        assert "outside the folder" in failed[rel], proc.stderr
    assert "resolves outside the folder" in failed["zero-link"]
    assert "resolves outside the folder" in failed["secret-link"]
    assert "not a regular file" in failed["pipe"]
    assert not any("sha256 mismatch" in ln for ln in failed.values())  # nothing outside was hashed


@pytest.mark.parametrize("kind", ["dev-zero-link", "fifo"])
def test_inspect_refuses_a_manifest_that_is_not_a_regular_file(artifact, tmp_path, kind):
    out = copy_artifact(artifact, tmp_path / "q")
    (out / "lmfoundry.json").unlink()
    if kind == "fifo":
        os.mkfifo(out / "lmfoundry.json")
    else:
        os.symlink("/dev/zero", out / "lmfoundry.json")
    proc = run_sub(["inspect", str(out)], timeout=60)
    assert_one_error(proc.returncode, proc.stderr, "lmfoundry.json")


def test_index_pointing_outside_the_model_folder_is_refused(model, calib, tmp_path, capsys):
    other = tiny_model_folder(tmp_path / "other", "llama", seed=5)
    victim = tmp_path / "victim"
    victim.mkdir()
    for f in model.iterdir():
        if f.suffix != ".safetensors":
            (victim / f.name).write_bytes(f.read_bytes())
    from safetensors import safe_open

    with safe_open(str(other / "model.safetensors"), "pt") as st:
        names = list(st.keys())
    (victim / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {n: "../other/model.safetensors" for n in names}}))
    out = tmp_path / "out"
    code, _, err = run_cli(["quantize", str(victim), "-o", str(out), *QUANT, "--calib", str(calib)], capsys)
    assert_one_error(code, err, "outside the folder")
    assert not out.exists()


# ------------------------------------------------------------------ 8: one line, no traceback
@pytest.mark.parametrize("content", ["[1, 2]", "[" * 100_000 + "]" * 100_000, '"just a string"', "\xff\xfe"])
def test_inspect_malformed_manifest_is_one_line(artifact, tmp_path, content, capsys):
    out = copy_artifact(artifact, tmp_path / "q")
    (out / "lmfoundry.json").write_bytes(content.encode("latin-1") if content == "\xff\xfe" else content.encode())
    code, _, err = run_cli(["inspect", str(out)], capsys)
    assert_one_error(code, err, "corrupt manifest")


def test_inspect_tolerates_wrong_field_types(artifact, tmp_path, capsys):
    out = copy_artifact(artifact, tmp_path / "q")
    manifest = json.loads((out / "lmfoundry.json").read_text())
    manifest.update(recipe="rtn", calibration=[1], layers={"0": "x", "1": {"q": {"weight_rel_error": "big"}}},
                    peak_rss_bytes="lots", tool_versions=[["torch", "2"]], warnings=7, source_model=None,
                    promotion="yes")
    (out / "lmfoundry.json").write_text(json.dumps(manifest))
    code, stdout, err = run_cli(["inspect", str(out)], capsys)
    assert code == 0, err
    assert "Traceback" not in err and "verified" in stdout and "n/a" in stdout


RECIPE_CASES = {
    "per_channel string": ("quantize: {per_channel: 'no'}", "quantize.per_channel"),
    "ignore int": ("quantize: {ignore: 5}", "quantize.ignore"),
    "targets string": ("quantize: {targets: Linear}", "quantize.targets"),
    "options list": ("quantize: {options: [1]}", "quantize.options"),
    "group_size string": ("quantize: {group_size: x}", "quantize.group_size"),
    "scheme list": ("quantize: {scheme: [1]}", "quantize.scheme"),
    "dtype unknown": ("quantize: {dtype: foo}", "quantize.dtype"),
    "num_samples string": ("calibration: {num_samples: abc}", "calibration.num_samples"),
    "seed 1e23 (a YAML string)": ("calibration: {seed: 1e23}", "calibration.seed"),
    "seed 1.0e+23 (a float)": ("calibration: {seed: 1.0e+23}", "calibration.seed"),
    "propagate unknown": ("calibration: {propagate: sideways}", "calibration.propagate"),
}


@pytest.mark.parametrize("case", list(RECIPE_CASES))
def test_recipe_value_of_wrong_type(case, model, calib, tmp_path, capsys):
    yaml_text, key = RECIPE_CASES[case]
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml_text + "\n")
    out = tmp_path / "out"
    code, _, err = run_cli(["quantize", str(model), "-o", str(out), *QUANT, "--calib", str(calib),
                            "--recipe", str(recipe)], capsys)
    assert_one_error(code, err, key)
    assert listing(tmp_path) == ["r.yaml"]


@pytest.mark.parametrize("extra,needle", [(["--recipe", "RECIPE"], "quantize.ignore"),
                                          (["--ctx", "1e5"], "--ctx"), (["--seed", "1e23"], "--seed")])
def test_doctor_recipe_value_of_wrong_type(extra, needle, model, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("quantize: {ignore: 5}\n")
    args = [str(recipe) if a == "RECIPE" else a for a in extra]
    code, _, err = run_cli(["doctor", str(model), *args], capsys)
    assert_one_error(code, err, needle)


@pytest.mark.parametrize("flag,value", [("--seed", "1e23"), ("--seed", str(10**23)), ("--seed", "-1"),
                                        ("--num-samples", "1.5"), ("--group-size", "0")])
def test_integer_flags_out_of_range(flag, value, model, calib, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["quantize", str(model), "-o", str(out), *QUANT, "--calib", str(calib), flag, value]
    code, _, err = run_cli(args, capsys)
    assert_one_error(code, err, flag, "whole number")
    assert not out.exists()


def _unwritable(kind: str, tmp_path: Path) -> Path:
    if kind == "sysfs":
        if not Path("/sys").is_dir():
            pytest.skip("no /sys on this system")
        return Path("/sys/lmfoundry-reliability-test/out")
    if kind == "parent is a file":
        (tmp_path / "afile").write_text("x")
        return tmp_path / "afile" / "out"
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.access(ro, os.W_OK):  # root ignores the mode bits
        ro.chmod(0o755)
        pytest.skip("running as a user that can write to mode-555 folders")
    return ro / "out"


@pytest.mark.parametrize("kind", ["sysfs", "parent is a file", "chmod 555"])
def test_unwritable_output_is_one_line(kind, model, calib, tmp_path, capsys, monkeypatch):
    from lmfoundry.calibration import data

    out = _unwritable(kind, tmp_path)
    before = listing(tmp_path)

    def no_model_work(*a, **k):
        raise AssertionError("calibration was loaded before the output was checked")

    monkeypatch.setattr(data, "load_calibration", no_model_work)
    code, _, err = run_cli(["quantize", str(model), "-o", str(out), *QUANT, "--calib", str(calib)], capsys)
    assert_one_error(code, err, "cannot")
    assert listing(tmp_path) == before
    assert not out.exists()
    if kind == "chmod 555":
        (tmp_path / "ro").chmod(0o755)


@pytest.mark.parametrize("record", [{"messages": [{"content": "hello there, friend"}]},
                                    {"messages": ["hello there, friend"]},
                                    {"messages": [{"role": "user", "content": 5}]}])
def test_calib_chat_record_without_role(record, model, tmp_path, capsys):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"text": "the model layer weight " * 30}) + "\n" + json.dumps(record) + "\n")
    out = tmp_path / "out"
    code, _, err = run_cli(["quantize", str(model), "-o", str(out), *QUANT, "--calib", str(chat)], capsys)
    assert_one_error(code, err, f"{chat}:2", "message 0")
    assert not out.exists()


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo"])
def test_calib_device_or_fifo_is_refused(kind, model, tmp_path):
    source = Path("/dev/zero")
    if kind == "fifo":
        source = tmp_path / "calib.txt"
        os.mkfifo(source)
    out = tmp_path / "out"
    proc = run_sub(["quantize", str(model), "-o", str(out), *QUANT, "--calib", str(source)], timeout=120)
    assert_one_error(proc.returncode, proc.stderr, "not a regular file")
    assert not out.exists()


@pytest.mark.parametrize("kind", ["fifo", "gguf symlink to /dev/zero"])
def test_model_path_that_is_a_device_or_fifo(kind, calib, tmp_path):
    if kind == "fifo":
        source = tmp_path / "model"
        os.mkfifo(source)
    else:
        source = tmp_path / "model.gguf"
        os.symlink("/dev/zero", source)
    out = tmp_path / "out"
    proc = run_sub(["quantize", str(source), "-o", str(out), *QUANT, "--calib", str(calib)], timeout=60)
    assert_one_error(proc.returncode, proc.stderr, "not a regular file or folder")
    assert not out.exists()


def test_calib_binary_junk_is_refused(model, tmp_path, capsys):
    junk = tmp_path / "calib.txt"
    junk.write_bytes(b"\0" * 100_000)
    out = tmp_path / "out"
    code, _, err = run_cli(["quantize", str(model), "-o", str(out), *QUANT, "--calib", str(junk)], capsys)
    assert_one_error(code, err, "binary data")
    assert not out.exists()
