"""Issue 16, cases 6 and 7 for compile and the checkpoint/engine readers: paths from untrusted
artifacts stay inside their folder, lying or truncated safetensors and malformed engine.json are
one-line errors, and a refused or failed `compile` leaves nothing behind.

| case | before | after | test |
|---|---|---|---|
| 6 engine.json kernel path `../x`, absolute, or symlink out (sha256 matching the outside file) | accepted, outside file hashed | EngineIntegrityError (exit 4), one line | test_engine_kernel_path_outside_the_bundle_is_refused |
| 6 engine kernel file is a folder / FIFO | IsADirectoryError traceback / read blocks forever | refused: not a regular file | test_engine_kernel_file_must_be_a_regular_file |
| 6 engine.json weights file name `../x` | accepted | refused, one line | test_engine_json_is_validated[weights-name-escapes] |
| 6 index weight_map `../x`, absolute, symlink out (runtime CheckpointReader) | outside file read | UserError, one line | test_index_pointing_outside_is_refused |
| 6 index names a folder / a FIFO; compile shard that is a FIFO | traceback / compile hangs | UserError: not a regular file | test_index_shard_must_be_a_regular_file, test_compile_refuses_a_fifo_shard |
| 6 compile shard symlinked out of the folder | outside file read | UserError | test_compile_refuses_a_shard_symlinked_out |
| 6 compile: any checkpoint file symlinked out (tokenizer.json -> elsewhere) | copied/linked into the bundle | UserError before compiling | test_compile_refuses_any_file_symlinked_out |
| 6 hub-cache snapshot (symlinks into its own blobs/) | loads | still loads | test_hub_cache_snapshot_links_are_allowed |
| 7 safetensors: truncated data, header longer than file, short file, junk/non-UTF-8/non-object header, overlapping / out-of-range / gapped offsets, trailing bytes, dtype x shape != bytes, unknown dtype, bad entry types | engine built (exit 0) or JSONDecodeError/struct.error/KeyError traceback | `corrupt safetensors file: ...` one line | test_lying_safetensors_is_refused[*] |
| 7 `compile` CLI on a truncated checkpoint | engine built, exit 0 | exit 2, one `error:` line, no output folder | test_compile_cli_refuses_truncated_checkpoint_and_writes_nothing |
| 7 engine.json not JSON / not UTF-8 / not an object / a folder / missing kernels or sha256 / kernels, files of the wrong type | JSONDecodeError, UnicodeDecodeError, AttributeError, IsADirectoryError, KeyError, TypeError tracebacks | `malformed engine.json: ...` one line | test_engine_json_is_validated[*], test_engine_json_that_is_a_folder |
| 7 engine.json missing archs/weights, capability "90" or true, cuda "twelve", block_size 0, fusion applied "yes" | accepted (KeyError/ValueError later, or silently wrong) | one line at read time | test_engine_json_is_validated[*] |
| 7 quantization_config sections of the wrong type | AttributeError/ValueError traceback | one line | test_quantization_config_wrong_types_are_one_line |
| 7 a build that fails after starting (kernel failure) | half-written bundle and compile.log left in -o; rebuild had already deleted the old bundle | nothing created; old bundle intact; log moved to a temp file | test_failed_build_leaves_nothing_and_keeps_the_old_bundle |
| 7 -o holding a foreign engine.json (not ours) | its kernels/ and weights/ deleted | refused, nothing touched | test_foreign_engine_json_is_not_replaced |
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lmfoundry.checkpoint.headers import read_safetensors_header
from lmfoundry.compile import bundle
from lmfoundry.compile.source import load_checkpoint
from lmfoundry.engine_bundle import engine_manifest
from lmfoundry.errors import UserError


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert msg and "\n" not in msg, msg
    return msg


# ---- engine bundles (case 6 and the engine.json half of case 7) -------------------------------
def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fake_bundle(root: Path) -> Path:
    """A bundle with the manifest layout `compile` writes and one kernel's three files (their
    content is irrelevant to what is checked here: paths, types and hashes)."""
    engine = root / "engine"
    kdir = engine / "kernels" / "sm_90a"
    kdir.mkdir(parents=True)
    (engine / "weights").mkdir()
    files = {}
    for ext in ("cubin", "ptx", "json"):
        (kdir / f"k.{ext}").write_bytes(f"{ext} bytes".encode())
        files[ext] = f"kernels/sm_90a/k.{ext}"
    manifest = {
        "format": "lmfoundry-engine/1",
        "model": {"model_type": "llama", "dtype": "bfloat16"},
        "kv_cache": {"dtype": "auto", "kernel_type": "bf16", "block_size": 16, "strategy": "tensor"},
        "archs": {"hopper": {"capability": 90, "sm": "sm_90a"}},
        "toolchain": {"triton": "3.7.1", "ptxas": "12.8", "cuda": "12.8"},
        "fusions": [{"name": "self_attn.qkv_proj", "kind": "gemm", "members": ["q", "k", "v"], "applied": True,
                     "reason": ""}],
        "weights": {"mode": "copy", "files": {"config.json": {"bytes": 2, "sha256": _sha(b"{}")}}},
        "kernels": [{"key": "k", "kernel": "silu_mul", "sm": "sm_90a", "capability": 90, "types": {"act": "bf16"},
                     "semantics": {}, "covers": [], "files": files,
                     "sha256": {ext: _sha((engine / rel).read_bytes()) for ext, rel in files.items()}}],
    }
    (engine / "weights" / "config.json").write_text("{}")
    (engine / "engine.json").write_text(json.dumps(manifest))
    return engine


def _load(engine: Path) -> dict:
    manifest = engine_manifest.read_manifest(engine)
    engine_manifest.verify(engine, manifest)
    return manifest


def _set_kernel_file(engine: Path, rel: str, data: bytes) -> None:
    m = json.loads((engine / "engine.json").read_text())
    m["kernels"][0]["files"]["cubin"] = rel
    m["kernels"][0]["sha256"]["cubin"] = _sha(data)
    (engine / "engine.json").write_text(json.dumps(m))


def test_fake_bundle_is_accepted(tmp_path):
    """The control: the well-formed bundle the other tests corrupt loads."""
    assert _load(fake_bundle(tmp_path))["kernels"][0]["key"] == "k"


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_engine_kernel_path_outside_the_bundle_is_refused(tmp_path, how):
    engine = fake_bundle(tmp_path)
    secret = tmp_path / "outside.bin"
    secret.write_bytes(b"not part of the bundle")
    if how == "dotdot":
        rel = "../outside.bin"
    elif how == "absolute":
        rel = str(secret)
    else:
        rel = "kernels/sm_90a/k.cubin"
        (engine / rel).unlink()
        os.symlink(secret, engine / rel)
    _set_kernel_file(engine, rel, secret.read_bytes())  # a hash that matches: only the path is wrong
    with pytest.raises(engine_manifest.EngineIntegrityError) as exc:
        _load(engine)
    assert "outside" in _one_line(exc)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_engine_kernel_file_must_be_a_regular_file(tmp_path, kind):
    engine = fake_bundle(tmp_path)
    target = engine / "kernels" / "sm_90a" / "k.cubin"
    target.unlink()
    target.mkdir() if kind == "folder" else os.mkfifo(target)
    with pytest.raises(engine_manifest.EngineIntegrityError) as exc:
        _load(engine)
    assert "not a regular file" in _one_line(exc)


def _without(key: str):
    return lambda m: m.pop(key)


ENGINE_JSON_BREAKAGE = {
    "not-json": ("raw", b"{\"format\": \"lmfoundry-engine/1\", \"kernels\": [", "not valid JSON"),
    "not-utf8": ("raw", b"\xff\xfe\x00junk", "not valid JSON"),
    "not-an-object": ("raw", b"[1, 2, 3]", "top level must be an object"),
    "missing-kernels": ("edit", _without("kernels"), "has no 'kernels'"),
    "missing-archs": ("edit", _without("archs"), "has no 'archs'"),
    "missing-weights": ("edit", _without("weights"), "has no 'weights'"),
    "kernels-not-a-list": ("edit", lambda m: m.update(kernels={"k": 1}), "kernels must be a list"),
    "kernel-not-an-object": ("edit", lambda m: m.update(kernels=["k"]), "kernels[0] must be an object"),
    "files-not-an-object": ("edit", lambda m: m["kernels"][0].update(files="k.cubin"), "files must be an object"),
    "file-path-not-a-string": ("edit", lambda m: m["kernels"][0]["files"].update(cubin=7), "must be a string"),
    "missing-sha256": ("edit", lambda m: m["kernels"][0]["sha256"].pop("ptx"), "sha256 has no 'ptx'"),
    "capability-a-string": ("edit", lambda m: m["archs"]["hopper"].update(capability="90"), "must be an integer"),
    "capability-true": ("edit", lambda m: m["kernels"][0].update(capability=True), "must be an integer"),
    "cuda-not-a-version": ("edit", lambda m: m["toolchain"].update(cuda="twelve"), "toolchain.cuda"),
    "fusion-applied-a-string": ("edit", lambda m: m["fusions"][0].update(applied="yes"), "must be true or false"),
    "block-size-zero": ("edit", lambda m: m["kv_cache"].update(block_size=0), "block_size must be positive"),
    "weights-name-escapes": ("edit", lambda m: m["weights"]["files"].update({"../x": {}}), "not a plain file name"),
}


@pytest.mark.parametrize("case", sorted(ENGINE_JSON_BREAKAGE))
def test_engine_json_is_validated(tmp_path, case):
    engine = fake_bundle(tmp_path)
    kind, change, expected = ENGINE_JSON_BREAKAGE[case]
    if kind == "raw":
        (engine / "engine.json").write_bytes(change)
    else:
        m = json.loads((engine / "engine.json").read_text())
        change(m)
        (engine / "engine.json").write_text(json.dumps(m))
    with pytest.raises(UserError) as exc:
        _load(engine)
    assert expected in _one_line(exc)


def test_engine_json_that_is_a_folder(tmp_path):
    engine = fake_bundle(tmp_path)
    (engine / "engine.json").unlink()
    (engine / "engine.json").mkdir()
    with pytest.raises(UserError) as exc:
        _load(engine)
    assert "not a regular file" in _one_line(exc)


# ---- safetensors index and shards (case 6) -----------------------------------------------------
def _tiny_shard(path: Path, value: float = 1.0) -> Path:
    save_file({"model.norm.weight": torch.full((4,), value)}, str(path))
    return path


def _index(folder: Path, shard: str) -> None:
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"model.norm.weight": shard}}))


def _model_folder(root: Path) -> Path:
    folder = root / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_index_pointing_outside_is_refused(tmp_path, how):
    from lmfoundry.checkpoint.folder import CheckpointReader

    folder = _model_folder(tmp_path)
    outside = _tiny_shard(tmp_path / "outside.safetensors", 7.0)
    if how == "dotdot":
        _index(folder, "../outside.safetensors")
    elif how == "absolute":
        _index(folder, str(outside))
    else:
        os.symlink(outside, folder / "model-00001-of-00001.safetensors")
        _index(folder, "model-00001-of-00001.safetensors")
    with pytest.raises(UserError) as exc:
        CheckpointReader(folder)
    assert "outside the folder" in _one_line(exc)


def test_index_inside_the_folder_is_read(tmp_path):
    """The control: an index naming a shard in a subfolder of the checkpoint works."""
    from lmfoundry.checkpoint.folder import CheckpointReader

    folder = _model_folder(tmp_path)
    (folder / "shards").mkdir()
    _tiny_shard(folder / "shards" / "a.safetensors", 3.0)
    _index(folder, "shards/a.safetensors")
    reader = CheckpointReader(folder)
    assert torch.equal(reader.get(["model.norm.weight"])["model.norm.weight"], torch.full((4,), 3.0))


def test_index_shard_must_be_a_regular_file(tmp_path):
    from lmfoundry.checkpoint.folder import CheckpointReader

    folder = _model_folder(tmp_path)
    (folder / "dir.safetensors").mkdir()
    _index(folder, "dir.safetensors")
    with pytest.raises(UserError) as exc:
        CheckpointReader(folder)
    assert "not a regular file" in _one_line(exc)


def test_hub_cache_snapshot_links_are_allowed(tmp_path):
    """A Hugging Face hub cache snapshot is all symlinks into its repo's blobs/: still a checkpoint."""
    from lmfoundry.checkpoint.folder import CheckpointReader

    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    blob = _tiny_shard(repo / "blobs" / "deadbeef", 5.0)
    (repo / "blobs" / "cfg").write_text(json.dumps({"model_type": "llama"}))
    os.symlink("../../blobs/deadbeef", snap / "model.safetensors")
    os.symlink("../../blobs/cfg", snap / "config.json")
    assert CheckpointReader(snap).index == {"model.norm.weight": snap / "model.safetensors"}
    assert blob.exists()


def test_compile_refuses_a_shard_symlinked_out(make_checkpoint, tmp_path):
    ckpt = make_checkpoint(weights=False)
    outside = make_checkpoint() / "model.safetensors"
    os.symlink(outside, ckpt / "model.safetensors")
    with pytest.raises(UserError) as exc:
        load_checkpoint(ckpt)
    assert "outside the folder" in _one_line(exc)


def test_compile_refuses_any_file_symlinked_out(make_checkpoint, tmp_path):
    """compile copies or links every file of the checkpoint into the bundle: a tokenizer.json that
    is a symlink to a file elsewhere must not be carried into it."""
    ckpt = make_checkpoint(weights=False)
    secret = tmp_path / "id_rsa"
    secret.write_text("private")
    os.symlink(secret, ckpt / "tokenizer.json")
    with pytest.raises(UserError) as exc:
        load_checkpoint(ckpt)
    assert "outside the folder" in _one_line(exc)


@pytest.mark.timeout(60)
def test_compile_refuses_a_fifo_shard(make_checkpoint):
    ckpt = make_checkpoint(weights=False)
    os.mkfifo(ckpt / "model.safetensors")
    with pytest.raises(UserError) as exc:
        load_checkpoint(ckpt)
    assert "not a regular file" in _one_line(exc)


# ---- lying safetensors (case 7) ---------------------------------------------------------------
def _rewrite(path: Path, header: dict | bytes, data: bytes, length: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def _split(path: Path) -> tuple[dict, bytes]:
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def _first_two(header: dict) -> tuple[str, str]:
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    return names[0], names[1]


def _overlap(h: dict, d: bytes):
    a, b = _first_two(h)
    size = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
    h[b]["data_offsets"] = [h[a]["data_offsets"][0], h[a]["data_offsets"][0] + size]
    return h, d


def _out_of_range(h: dict, d: bytes):
    name = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])
    h[name]["data_offsets"] = [len(d) + 64, len(d) + 64 + h[name]["data_offsets"][1] - h[name]["data_offsets"][0]]
    return h, d


def _dtype_mismatch(h: dict, d: bytes):
    a, _ = _first_two(h)
    h[a]["shape"] = [x * 2 for x in h[a]["shape"]]
    return h, d


def _gap(h: dict, d: bytes):
    for k in h:
        if k != "__metadata__":
            h[k]["data_offsets"] = [o + 16 for o in h[k]["data_offsets"]]
    return h, bytes(16) + d


SAFETENSORS_BREAKAGE = {
    "truncated-data": (lambda h, d: (h, d[: len(d) // 2]), "truncated"),
    "header-longer-than-file": ("length", "truncated"),
    "shorter-than-8-bytes": ("tiny", "shorter than the 8-byte"),
    "junk-header": (lambda h, d: (b"\x00garbage{", d), "not JSON"),
    "non-utf8-header": (lambda h, d: (b"{\"\xff\xfe\": 1}", d), "not JSON"),
    "header-not-an-object": (lambda h, d: (b"[1, 2]", d), "not a JSON object"),
    "overlapping-offsets": (_overlap, "overlaps"),
    "offsets-out-of-range": (_out_of_range, "data section"),
    "gap-between-tensors": (_gap, "gap"),
    "trailing-bytes": (lambda h, d: (h, d + bytes(32)), "cover"),
    "dtype-shape-vs-bytes": (_dtype_mismatch, "needs"),
    "unknown-dtype": (lambda h, d: (h | {k: {**v, "dtype": "Q4"} for k, v in h.items() if k != "__metadata__"}, d),
                      "unknown dtype"),
    "offsets-not-integers": (lambda h, d: (h | {k: {**v, "data_offsets": ["0", "1"]} for k, v in h.items()
                                                if k != "__metadata__"}, d), "data_offsets"),
    "entry-missing-shape": (lambda h, d: (h | {k: {"dtype": v["dtype"], "data_offsets": v["data_offsets"]}
                                               for k, v in h.items() if k != "__metadata__"}, d), "shape"),
    "metadata-not-strings": (lambda h, d: (h | {"__metadata__": {"format": 1}}, d), "__metadata__"),
}


@pytest.mark.parametrize("case", sorted(SAFETENSORS_BREAKAGE))
def test_lying_safetensors_is_refused(make_checkpoint, case):
    ckpt = make_checkpoint()
    st = ckpt / "model.safetensors"
    change, expected = SAFETENSORS_BREAKAGE[case]
    header, data = _split(st)
    if change == "length":
        raw = st.read_bytes()
        st.write_bytes(struct.pack("<Q", len(raw) * 10) + raw[8:])
    elif change == "tiny":
        st.write_bytes(b"\x10\x00")
    else:
        _rewrite(st, *change(copy.deepcopy(header), data))
    with pytest.raises(UserError) as exc:
        load_checkpoint(ckpt)
    msg = _one_line(exc)
    assert "corrupt safetensors" in msg and expected in msg, msg


def test_valid_safetensors_header_parses(make_checkpoint):
    """The control: what save_file writes passes, with every tensor's dtype and shape."""
    ckpt = make_checkpoint()
    header = read_safetensors_header(ckpt / "model.safetensors")
    assert header["model.norm.weight"]["dtype"] == "BF16" and header["model.norm.weight"]["shape"] == [128]
    assert "__metadata__" not in header


@pytest.mark.parametrize("case", ["groups-a-list", "weights-a-string", "num-bits-a-word", "ignore-a-number"])
def test_quantization_config_wrong_types_are_one_line(make_checkpoint, case):
    ckpt = make_checkpoint(weights=False)
    cfg = json.loads((ckpt / "config.json").read_text())
    q = cfg["quantization_config"]
    if case == "groups-a-list":
        q["config_groups"] = [q["config_groups"]["group_0"]]
    elif case == "weights-a-string":
        q["config_groups"]["group_0"]["weights"] = "int4"
    elif case == "num-bits-a-word":
        q["config_groups"]["group_0"]["weights"]["num_bits"] = "four"
    else:
        q["ignore"] = 3
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError) as exc:
        load_checkpoint(ckpt)
    _one_line(exc)


# ---- the compile CLI: one line, exit code, nothing left behind --------------------------------
def _cli(args: list[str], capsys) -> tuple[int, str]:
    from lmfoundry.cli import main

    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err
    return exc.value.code, err


def _entries(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def test_compile_cli_refuses_truncated_checkpoint_and_writes_nothing(make_checkpoint, tmp_path, capsys):
    ckpt = make_checkpoint()
    st = ckpt / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size - 1000])
    out = tmp_path / "out" / "engine"
    before = _entries(tmp_path)
    code, err = _cli(["compile", str(ckpt), "--arch", "hopper", "-o", str(out), "--quiet"], capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and "truncated" in err and "Traceback" not in err
    assert _entries(tmp_path) == before  # not even the parent of -o


def test_failed_build_leaves_nothing_and_keeps_the_old_bundle(make_checkpoint, tmp_path, capsys, monkeypatch):
    """A build that fails after it started writing (here: every kernel fails to compile) leaves no
    half-written bundle, no staging folder and no created parent; a rebuild over an existing bundle
    that fails leaves the old bundle as it was."""
    ckpt = make_checkpoint(weights=False)

    def failing_jobs(jobs, workers, cache, log_path, on_done=lambda r: None):
        Path(jobs[0]["out_dir"]).mkdir(parents=True, exist_ok=True)
        (Path(jobs[0]["out_dir"]) / "partial.cubin").write_bytes(b"half")
        Path(log_path).write_text("ptxas fatal: planted failure\n")
        return [{"id": j["id"], "ok": False, "error": "planted failure\nsecond line"} for j in jobs]

    monkeypatch.setattr(bundle, "run_jobs", failing_jobs)
    out = tmp_path / "new" / "engine"
    code, err = _cli(["compile", str(ckpt), "--arch", "hopper", "-o", str(out), "--quiet"], capsys)
    assert code == 3 and err.count("\n") == 1 and "planted failure" in err and "Traceback" not in err
    assert not (tmp_path / "new").exists()
    log = Path(err.rsplit("details: ", 1)[1].rstrip(")\n"))
    assert log.read_text() == "ptxas fatal: planted failure\n" and not log.is_relative_to(tmp_path)
    log.unlink()

    old = fake_bundle(tmp_path / "old")
    (old / "README.txt").write_text("mine")
    snapshot = {p.relative_to(old): p.read_bytes() for p in old.rglob("*") if p.is_file()}
    code, err = _cli(["compile", str(ckpt), "--arch", "hopper", "-o", str(old), "--quiet"], capsys)
    assert code == 3
    Path(err.rsplit("details: ", 1)[1].rstrip(")\n")).unlink()
    assert {p.relative_to(old): p.read_bytes() for p in old.rglob("*") if p.is_file()} == snapshot
    assert _entries(old.parent) == {"engine"}  # no staging folder left next to it


def test_foreign_engine_json_is_not_replaced(make_checkpoint, tmp_path, capsys):
    ckpt = make_checkpoint(weights=False)
    out = tmp_path / "project"
    (out / "weights").mkdir(parents=True)
    (out / "weights" / "precious.bin").write_bytes(b"data")
    (out / "engine.json").write_text('{"name": "some other tool"}')
    code, err = _cli(["compile", str(ckpt), "--arch", "hopper", "-o", str(out), "--quiet"], capsys)
    assert code == 2 and err.count("\n") == 1 and "not an engine bundle" in err
    assert (out / "weights" / "precious.bin").read_bytes() == b"data"
