"""An engine bundle's manifest and files, checked before anything of it runs.

engine.json is untrusted input (a bundle may be downloaded): `read_manifest` bounds its size and
checks the type of every field the runtime reads; `verify` checks each kernel file and
`verify_weights` each weights file against the sha256 recorded at build time, so a modified or
planted file refuses the bundle (`EngineIntegrityError`); `bundle_problems` lists every mismatch
for `lmfoundry inspect`. Compile writes these files (`lmfoundry.compile.bundle`) and eval-gate
records its verdict in them through `write_manifest` and `record_in_manifest`; this module is what
the runtime and `inspect` read them with, and the one place that says what the format is: its
name and version, its folders, what makes a folder a bundle, and where a tensor-parallel bundle
keeps each rank.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from lmfoundry.errors import UserError
from lmfoundry.manifest import contained_file, parse_json_object, read_bounded, sha256_file


class EngineIntegrityError(UserError):
    """A bundle file does not match the hash recorded at build time."""

    exit_code = 4


ENGINE_FORMAT = "lmfoundry-engine/1"  # engine.json's "format": compile writes it, read_manifest requires it
# an --arch cpu bundle whose compiled step takes embedding rows: a reader that knows only /1 would
# hand that step token ids, so such a bundle says /2 and those readers refuse it in one line
CPU_EMBEDDED_FORMAT = "lmfoundry-engine/2"
ENGINE_FORMATS = (ENGINE_FORMAT, CPU_EMBEDDED_FORMAT)
MANIFEST_NAME = "engine.json"
ENGINE_JSON_MAX_BYTES = 64 << 20  # a real engine.json is a few hundred KiB
WEIGHTS_FOLDER = "weights"  # a bundle's weights (each rank's own in a tensor-parallel bundle)
KERNELS_FOLDER = "kernels"  # kernels/<sm>/<key>.cubin|.ptx|.json
CPU_STEP_FOLDER = "cpu"  # an --arch cpu bundle's compiled step: cpu/<isa>/...
BUILT_FOLDERS = (KERNELS_FOLDER, WEIGHTS_FOLDER, CPU_STEP_FOLDER)  # what a rebuild replaces, besides rank folders
_RANK_FOLDER = re.compile(r"rank[0-9]+")


def is_engine_bundle(path: str | Path) -> bool:
    """Whether `path` is a bundle folder (it has an engine.json): what every command asks before
    choosing the bundle path over the checkpoint path; `read_manifest` then checks the file."""
    return (Path(path) / MANIFEST_NAME).is_file()


def holds_lmfoundry_bundle(folder: str | Path) -> bool:
    """Whether `folder` holds one of our bundles (an engine.json object of our format), not merely
    a file of that name: only then may a rebuild replace its kernels/, weights/ and engine.json."""
    try:
        manifest = json.loads((Path(folder) / MANIFEST_NAME).read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") in ENGINE_FORMATS


def write_manifest(bundle: str | Path, manifest: dict[str, Any]) -> None:
    """Write `manifest` as the bundle's engine.json through a temporary sibling renamed over it:
    a reader sees the old manifest or the new one, never half of one."""
    path = Path(bundle) / MANIFEST_NAME
    tmp = path.with_name(f".{MANIFEST_NAME}.{os.getpid()}")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, path)


def record_in_manifest(bundle: str | Path, key: str, record: Any) -> None:
    """Set `key` of the bundle's engine.json to `record` (eval-gate's `promotion`), every other
    field as written: the hashes engine.json holds still describe the same files."""
    path = Path(bundle) / MANIFEST_NAME
    manifest = parse_json_object(read_bounded(path, ENGINE_JSON_MAX_BYTES), path)
    manifest[key] = record
    write_manifest(bundle, manifest)


def own_weights(bundle: str | Path) -> Path:
    """The weights/ folder of one bundle: a bundle for one device, or one rank's inside a
    tensor-parallel bundle (`weights_folder` finds the model's config in either)."""
    return Path(bundle) / WEIGHTS_FOLDER


def rank_folder(rank: int) -> str:
    """The folder of rank `rank`'s own bundle inside a tensor-parallel bundle."""
    return f"rank{rank}"


def is_rank_folder(name: str) -> bool:
    return _RANK_FOLDER.fullmatch(name) is not None


def weights_folder(path: str | Path) -> Path:
    """The bundle's weights/ folder whose config.json the model is read from: rank 0's in a
    tensor-parallel bundle (its share names the whole model), the bundle's own otherwise."""
    top = Path(path)
    return own_weights(top / rank_folder(0) if bundle_degree(top) > 1 else top)


def bundle_degree(path: str | Path) -> int:
    """The tensor-parallel degree an engine bundle was compiled for (1: one device)."""
    manifest_path = Path(path) / MANIFEST_NAME
    manifest = parse_json_object(read_bounded(manifest_path, ENGINE_JSON_MAX_BYTES), manifest_path)
    if "tensor_parallel" not in manifest:
        return 1
    record = manifest["tensor_parallel"]
    size = record.get("size") if isinstance(record, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or size < 2:
        raise UserError(f"{manifest_path}: malformed tensor_parallel record (a size of 2 or more is expected)")
    return size


def rank_bundle(path: str | Path, rank: int) -> Path:
    """Rank `rank`'s bundle inside a tensor-parallel bundle, once its engine.json is the one the
    bundle's manifest records (each rank's own manifest then checks its files)."""
    engine = Path(path)
    manifest = parse_json_object(read_bounded(engine / MANIFEST_NAME, ENGINE_JSON_MAX_BYTES), engine / MANIFEST_NAME)
    ranks = manifest["tensor_parallel"].get("ranks")
    entry = ranks[rank] if isinstance(ranks, list) and rank < len(ranks) else None
    if not isinstance(entry, dict) or entry.get("path") != rank_folder(rank):
        raise UserError(f"{engine}/{MANIFEST_NAME}: malformed tensor_parallel record (no entry {rank_folder(rank)})")
    folder = engine / rank_folder(rank)
    if not (folder / MANIFEST_NAME).is_file() or sha256_file(folder / MANIFEST_NAME) != entry.get("engine_sha256"):
        raise EngineIntegrityError(f"{folder}/{MANIFEST_NAME}: missing, or not the one {engine}/{MANIFEST_NAME} records")
    return folder
_KIND_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", bool: "true or false"}


def _malformed(manifest_path: Path, why: str) -> UserError:
    return UserError(f"{manifest_path}: malformed engine.json: {why}")


def _field(obj: dict[str, Any], key: str, kind: type, where: str, manifest_path: Path) -> Any:
    """obj[key], refused unless present and of `kind` (JSON true is not an integer here)."""
    if key not in obj:
        raise _malformed(manifest_path, f"{where} has no {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise _malformed(manifest_path, f"{where}.{key} must be {_KIND_NAMES[kind]}, got {type(value).__name__}")
    return value


def check_manifest(manifest: Any, manifest_path: Path) -> dict[str, Any]:
    """`manifest` if it has every key, with the types, that the loader and the runtime read from
    engine.json. A hand-edited, truncated or foreign engine.json would otherwise surface as a
    KeyError or TypeError deep inside loading; this makes it one line naming the bad field. Paths
    are only checked lexically here (plain names under weights/); `verify` resolves kernel files."""
    if not isinstance(manifest, dict):
        raise _malformed(manifest_path, f"the top level must be an object, got {type(manifest).__name__}")
    if manifest.get("format") not in ENGINE_FORMATS:
        raise UserError(f"{manifest_path}: unknown engine format {manifest.get('format')!r}")
    f = functools.partial(_field, manifest_path=manifest_path)
    model = f(manifest, "model", dict, MANIFEST_NAME)
    if f(model, "dtype", str, "model") not in ("float16", "bfloat16"):
        raise _malformed(manifest_path, f"model.dtype {model['dtype']!r} is not float16 or bfloat16")
    kv = f(manifest, "kv_cache", dict, MANIFEST_NAME)
    f(kv, "dtype", str, "kv_cache")
    if f(kv, "block_size", int, "kv_cache") <= 0:
        raise _malformed(manifest_path, "kv_cache.block_size must be positive")
    archs = f(manifest, "archs", dict, MANIFEST_NAME)
    if manifest.get("target") == "cpu":  # `compile --arch cpu`: a compiled step, no cubins
        cpu = f(manifest, "cpu", dict, MANIFEST_NAME)
        f(cpu, "isa", str, "cpu")
        f(cpu, "torch", str, "cpu")
        if f(cpu, "max_tokens", int, "cpu") < 1:
            raise _malformed(manifest_path, "cpu.max_tokens must be positive")
        step = f(cpu, "step", dict, "cpu")
        f(step, "path", str, "cpu.step")
        f(step, "sha256", str, "cpu.step")
        if step.get("inputs", "ids") not in ("embeddings", "ids"):  # absent: built before it took embeddings
            raise _malformed(manifest_path, f"cpu.step.inputs must be 'embeddings' or 'ids', got {step['inputs']!r}")
        if (step.get("inputs") == "embeddings") != (manifest["format"] == CPU_EMBEDDED_FORMAT):
            raise _malformed(manifest_path, f"a step taking embedding rows is format {CPU_EMBEDDED_FORMAT} "
                                            "(and only such a step)")
    elif not archs:
        raise _malformed(manifest_path, "archs is empty")
    if manifest["format"] == CPU_EMBEDDED_FORMAT and manifest.get("target") != "cpu":
        raise _malformed(manifest_path, f"format {CPU_EMBEDDED_FORMAT} is an --arch cpu bundle's")
    for name in archs:
        arch = f(archs, name, dict, "archs")
        f(arch, "capability", int, f"archs.{name}")
        f(arch, "sm", str, f"archs.{name}")
    cuda = f(manifest, "toolchain", dict, MANIFEST_NAME).get("cuda")
    if cuda is not None and not (isinstance(cuda, str) and re.fullmatch(r"\d+\.\d+(\.\d+)*", cuda)):
        raise _malformed(manifest_path, f"toolchain.cuda must be a version like \"12.8\", got {cuda!r}")
    for i, fusion in enumerate(f(manifest, "fusions", list, MANIFEST_NAME)):
        if not isinstance(fusion, dict):
            raise _malformed(manifest_path, f"fusions[{i}] must be an object")
        for key, kind in (("name", str), ("kind", str), ("members", list), ("applied", bool)):
            f(fusion, key, kind, f"fusions[{i}]")
    if "lora" in manifest:  # `compile --max-loras`: the LoRA kernels' slots and rank
        lora = f(manifest, "lora", dict, MANIFEST_NAME)
        for key in ("max_loras", "max_rank"):
            if f(lora, key, int, "lora") < 1:
                raise _malformed(manifest_path, f"lora.{key} must be a positive integer")
    weights = f(manifest, "weights", dict, MANIFEST_NAME)
    for name in f(weights, "files", dict, "weights"):
        if name in ("", ".", "..") or "/" in name or "\\" in name or "\x00" in name:
            raise UserError(f"{manifest_path}: weights file {name!r} is not a plain file name inside weights/; "
                            "refusing the bundle")
        f(weights["files"], name, dict, "weights.files")
    for i, entry in enumerate(f(manifest, "kernels", list, MANIFEST_NAME)):
        where = f"kernels[{i}]"
        if not isinstance(entry, dict):
            raise _malformed(manifest_path, f"{where} must be an object")
        fields: tuple[tuple[str, type], ...] = (
            ("key", str), ("kernel", str), ("sm", str), ("capability", int), ("types", dict),
            ("semantics", dict), ("covers", list), ("files", dict), ("sha256", dict))
        for key, field_kind in fields:
            f(entry, key, field_kind, where)
        for ext in ("cubin", "json"):
            if ext not in entry["files"]:
                raise _malformed(manifest_path, f"{where}.files has no {ext!r}")
        for ext in entry["files"]:
            f(entry["files"], ext, str, f"{where}.files")
            f(entry["sha256"], ext, str, f"{where}.sha256")
    return manifest


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The bundle's engine.json, parsed and checked by `check_manifest`: every way it can be wrong
    (missing, not a regular file, not JSON, not an object, missing keys, wrong types) is one
    `UserError` line, never a traceback."""
    engine = Path(path)
    manifest_path = engine / MANIFEST_NAME
    if not os.path.lexists(manifest_path):
        raise UserError(f"{engine}: no engine.json (not an engine bundle; build one with `lmfoundry compile`)")
    try:
        st = os.stat(contained_file(engine, manifest_path.name))  # inside the bundle, a regular file
    except UserError as exc:
        raise UserError(f"{engine}: {exc}") from None
    if st.st_size > ENGINE_JSON_MAX_BYTES:
        raise _malformed(manifest_path, f"{st.st_size} bytes, larger than any engine.json lmfoundry writes")
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _malformed(manifest_path, f"not valid JSON ({exc})") from None
    except OSError as exc:
        raise UserError(f"{manifest_path}: cannot read it ({exc.strerror})") from None
    return check_manifest(manifest, manifest_path)


def _kernel_file(engine: Path, rel: str) -> Path:
    """engine/rel for a kernel file named by engine.json: inside the bundle after resolving
    symlinks, present, and a regular file — else the bundle is refused (EngineIntegrityError)."""
    try:
        return contained_file(engine, rel)
    except UserError as exc:
        raise EngineIntegrityError(f"{engine}: kernel file {exc}; refusing to load the bundle") from None


def verify(path: str | Path, manifest: dict[str, Any]) -> None:
    """Raise EngineIntegrityError unless every kernel file is a regular file inside the bundle
    (no `..`, absolute path or symlink out: engine.json may come with an untrusted download) and
    hashes to its recorded sha256."""
    engine = Path(path)
    for entry in manifest["kernels"]:
        for ext, rel in entry["files"].items():
            f = _kernel_file(engine, rel)
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            if digest != entry["sha256"][ext]:
                raise EngineIntegrityError(
                    f"{rel}: sha256 {digest[:16]}… does not match engine.json ({entry['sha256'][ext][:16]}…); "
                    "the bundle was modified or corrupted — refusing to load it"
                )


def bundle_problems(path: str | Path, manifest: dict[str, Any]) -> list[str]:
    """Every way the bundle's files differ from engine.json (empty: verified), for `inspect`:
    each kernel file, each weights file (listed, present, hash, nothing unlisted) and an
    `--arch cpu` bundle's compiled step. The loaders stop at the first of these."""
    engine = Path(path)
    problems = []
    files = [(rel, digest) for e in manifest["kernels"] for ext, rel in e["files"].items()
             for digest in [e["sha256"].get(ext)]]
    step = manifest.get("cpu", {}).get("step")
    if isinstance(step, dict):
        files.append((step["path"], step["sha256"]))
    listed = manifest["weights"]["files"]
    files += [(f"{WEIGHTS_FOLDER}/{name}", entry.get("sha256")) for name, entry in sorted(listed.items())]
    for rel, digest in files:
        try:
            f = contained_file(engine, rel)
        except UserError as exc:
            problems.append(str(exc))
            continue
        if digest is None or sha256_file(f) != digest:
            problems.append(f"{rel}: sha256 mismatch" if digest else f"{rel}: no sha256 recorded")
    weights = own_weights(engine)
    if weights.is_dir():
        problems += [f"weights/{p.name}: not listed in engine.json" for p in sorted(weights.iterdir())
                     if p.name not in listed]
    else:
        problems.append("weights/: missing")
    return problems


def verify_weights(path: str | Path, manifest: dict[str, Any]) -> None:
    """Raise EngineIntegrityError unless the bundle's weights folder holds exactly the files
    engine.json lists, each hashing to its recorded sha256 (config.json included). A file that
    is not listed is refused too: the loader would otherwise read a planted shard."""

    engine = Path(path)
    folder = own_weights(engine)
    listed = manifest.get("weights", {}).get("files", {})
    if not folder.is_dir():
        raise EngineIntegrityError(f"{engine}: no weights/ folder in the engine bundle")
    linked = sorted(n for n, e in listed.items() if "link" in e)
    if linked:
        raise UserError(f"{engine}: built with --weights link (weights/{linked[0]} points into "
                        f"{Path(listed[linked[0]]['link']).parent}); the runtime serves self-contained bundles: "
                        "rebuild with `lmfoundry compile ... --weights repack` (the default) or `--weights copy`")
    present = {p.name for p in folder.iterdir()}
    extra = sorted(present - set(listed))
    if extra:
        raise EngineIntegrityError(f"{folder / extra[0]}: not listed in engine.json; refusing to load the bundle")
    for name, entry in sorted(listed.items()):
        f = folder / name
        if not f.is_file():
            raise EngineIntegrityError(f"{f}: missing from the engine bundle")
        if "sha256" not in entry:
            raise EngineIntegrityError(f"{f}: engine.json records no sha256 for it (a bundle from an older "
                                       "lmfoundry); rebuild it with `lmfoundry compile`")
        digest = sha256_file(f)
        if digest != entry["sha256"]:
            raise EngineIntegrityError(
                f"weights/{name}: sha256 {digest[:16]}… does not match engine.json ({entry['sha256'][:16]}…); "
                "the bundle was modified or corrupted — refusing to load it")
