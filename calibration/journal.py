"""A per-layer journal in a quantize run's work folder, so a run killed at layer k (SIGKILL, OOM
killer, a preempted node) continues from layer k with `quantize --resume`.

After layer k's shard is written the journal records, atomically (write to a temporary name, then
rename): the calibration activations that enter layer k+1 (`activations_file`, one per rank), the report
so far, the writer's index state and the sha256 of every shard written. A resumed run checks each
recorded shard against its sha256, reloads the activations and continues; everything a layer
computes depends only on its weights and those activations, so the shards it writes are
byte-identical to an uninterrupted run's. The journal is keyed by everything that determines the
output (source files, recipe as applied, calibration token ids, tool versions): a journal of
another run is never continued.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmfoundry.distributed import ranks

JOURNAL = "journal.json"


def run_key(parts: dict[str, Any]) -> str:
    """sha256 of the JSON of everything that determines a run's output."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _sha256(path: Path) -> str:
    from lmfoundry.manifest import sha256_file

    return sha256_file(path)


def _replace_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, default=str))
    os.replace(tmp, path)


@dataclass
class LayerJournal:
    folder: Path
    key: str
    done: int = 0  # decoder layers whose shards are written
    state: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def open(cls, folder: Path, key: str) -> "LayerJournal":
        """The journal in `folder` if it belongs to this run (same key) and its shards are intact;
        otherwise an empty one (the run starts from layer 0)."""
        journal = cls(Path(folder), key)
        path = journal.folder / JOURNAL
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return journal
        if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("done"), int) \
                or not (journal.folder / activations_file(0, data["done"])).is_file():
            return journal
        shards = data.get("shards", {})
        if not all((journal.folder / name).is_file() and _sha256(journal.folder / name) == digest
                   for name, digest in shards.items()):
            return journal
        journal.done, journal.state = int(data["done"]), data
        return journal

    @staticmethod
    def find(parent: Path, prefix: str, key: str) -> "LayerJournal | None":
        """The most advanced journal of this run among `parent/prefix*` work folders left by
        processes that are no longer alive (None if there is none)."""
        best = None
        for folder in parent.glob(f"{prefix}*"):
            if not folder.is_dir() or folder.is_symlink() or process_alive(folder):
                continue
            journal = LayerJournal.open(folder, key)
            if journal.done and (best is None or journal.done > best.done):
                best = journal
        return best

    def restore(self, writer: Any, report: Any) -> list[torch.Tensor]:
        """Put the writer's index and the report back as they were after layer `done`; returns the
        calibration activations entering that layer (empty for a run without calibration data).
        A data-parallel rank gets its own share; a rank without a writer restores only that."""
        from safetensors.torch import load_file

        if writer is not None:
            writer.weight_map = dict(self.state["weight_map"])
            writer.total_bytes = int(self.state["total_bytes"])
            report.layers.update(self.state["layers"])
            report.layer_seconds.update(self.state.get("layer_seconds", {}))
            report.warnings.extend(self.state["warnings"])
        tensors = load_file(str(self.folder / activations_file(ranks().rank, self.done)))
        return [tensors[f"batch.{i}"] for i in range(len(tensors))]

    def record(self, done: int, writer: Any, report: Any, inputs: list[torch.Tensor] | None) -> None:
        """Layers [0, done) are written: save the activations entering layer `done`, then the
        journal (each replaced atomically, activations first). Under torchrun every rank saves
        its share of the activations and the writer rank writes the journal once all have."""
        from safetensors.torch import save_file

        group = ranks()
        name = activations_file(group.rank, done)
        tmp = self.folder / f".{name}.tmp"
        save_file({f"batch.{i}": x.contiguous().cpu() for i, x in enumerate(inputs or [])}, str(tmp))
        os.replace(tmp, self.folder / name)
        group.barrier()  # every rank's activations for `done` are on disk before the journal says so
        previous, self.done = self.done, done
        if writer is None:
            return
        shards = dict(self.state.get("shards", {}))
        for shard in sorted(set(writer.weight_map.values()) - set(shards)):
            shards[shard] = _sha256(writer.tmp / shard)
        self.state = {"key": self.key, "done": done, "shards": shards, "weight_map": writer.weight_map,
                      "total_bytes": writer.total_bytes, "layers": report.layers, "layer_seconds": report.layer_seconds,
                      "warnings": report.warnings}
        _replace_json(self.folder / JOURNAL, self.state)
        for rank in range(group.world_size):  # the journal no longer points at them
            (self.folder / activations_file(rank, previous)).unlink(missing_ok=True)

    def close(self) -> None:
        """Remove the journal's files (the run finished: they are not part of the artifact)."""
        (self.folder / JOURNAL).unlink(missing_ok=True)
        for f in self.folder.glob("activations*.safetensors"):
            f.unlink(missing_ok=True)


def activations_file(rank: int, done: int) -> str:
    """The file of one rank's activations entering layer `done`. Named by layer, because under
    torchrun a rank may save layer k+1's before the journal (written once every rank has) moves
    from k to k+1: a crash in between must leave layer k's files for the journal to point at."""
    return f"activations-{done:05d}-rank{rank}.safetensors"


def process_alive(folder: Path) -> bool:
    """Whether the process that made a work folder (`...-PID` or `...-PID-RANDOM`) still runs; a
    name without a process id counts as dead."""
    import re

    m = re.search(r"-(\d+)(?:-[0-9a-f]+)?$", folder.name)
    if m is None:
        return False
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
